"""Tied worker groups: TP consecutive bundles on one node, the leader actor owns the engine;
data parallelism is the number of tied groups."""

from __future__ import annotations

import importlib
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rollgen.distributed.virtual_cluster import RayVirtualCluster
from rollgen.errors import ConfigError, RollgenError, WorkerError

logger = logging.getLogger(__name__)

#: How often ``until_dead`` asks a killed actor that still answers again.
DEATH_POLL_S = 0.02


@dataclass(frozen=True)
class TiedGroup:
    """One engine's bundles: ``node`` (placement group index) and its local bundle indices."""

    node: int
    bundle_indices: tuple[int, ...]


def tied_groups(bundles_per_node: Sequence[int], tp_size: int) -> list[TiedGroup]:
    """Consecutive groups of ``tp_size`` bundles within each node, nodes in order."""
    groups = [
        TiedGroup(node, tuple(range(start, start + tp_size)))
        for node, count in enumerate(bundles_per_node)
        for start in range(0, count - tp_size + 1, tp_size)
    ]
    if not groups:
        raise ConfigError(
            f"no tensor-parallel group of {tp_size} fits: nodes have {list(bundles_per_node)} "
            f"bundles, and a group must sit on one node. Use tensor_parallel_size <= "
            f"{max(bundles_per_node)} or give nodes more GPUs"
        )
    return groups


class RayWorkerBuilder:
    """Creates the actor of one tied group: ``cls_path`` ("module:Class") built with the
    arguments ``args(group, index)`` gives (computed here, on the driver)."""

    def __init__(self, cls_path: str, args: Callable[[TiedGroup, int], tuple[Any, ...]]) -> None:
        self.cls_path, self.args = cls_path, args

    def build(self, options: dict[str, Any], group: TiedGroup, index: int) -> Any:
        module, _, name = self.cls_path.partition(":")
        cls = getattr(importlib.import_module(module), name)
        # a class's concurrency groups (beside the default one) are set where it becomes an actor
        remote = ray.remote(concurrency_groups=getattr(cls, "concurrency_groups", None))(cls)  # type: ignore[call-overload]
        return remote.options(**options).remote(*self.args(group, index))


class RayWorkerGroup:
    """One leader actor per tied group, placed on the group's first bundle. Worker methods are
    named by reference (``group.call_all(EngineWorker.wake, tags)``), so a renamed method is a
    type error, not a string that no longer matches.

    ``one_at_a_time``: each actor is started only once the one before it is up. Engines that
    share a GPU need it: an engine sizes its KV cache from the whole device's free memory, so
    what another engine takes while it measures is counted as its own (vLLM then sizes its
    cache too small, or finds no memory for it: vllm-project/vllm#55827). A start that fails
    ends the actors started before it (``cleanup`` first, as ``shutdown`` takes it)."""

    def __init__(
        self,
        cluster: RayVirtualCluster,
        builder: RayWorkerBuilder,
        tp_size: int,
        name_prefix: str = "rollgen",
        leader_resources: dict[str, float] | None = None,
        one_at_a_time: bool = False,
        cleanup: Callable[..., Any] | None = None,
    ) -> None:
        self.cluster = cluster
        self.groups = tied_groups(cluster.bundles_per_node, tp_size)
        self.names = [f"{name_prefix}-dp{i}" for i in range(len(self.groups))]
        self.workers: list[Any] = []
        self._builder, self._options = builder, []
        #: Seconds ``get`` waits for an answer before it kills the workers that have not given
        #: one (None: for ever; the engine's ``call_timeout_s`` once it has started).
        self.call_timeout_s: float | None = None
        pgs = cluster.get_placement_groups()
        resources = leader_resources or {"num_cpus": cluster.cpus_per_bundle / 2}
        started = False
        try:
            for i, group in enumerate(self.groups):
                options = {
                    "scheduling_strategy": PlacementGroupSchedulingStrategy(
                        placement_group=pgs[group.node],
                        placement_group_bundle_index=group.bundle_indices[0],
                        placement_group_capture_child_tasks=True,
                    ),
                    "max_concurrency": 1,
                    **resources,
                }
                self._options.append(options)
                self.workers.append(builder.build(options, group, i))
                if one_at_a_time:
                    self.get([self.workers[-1].__ray_ready__.remote()], names=[self.names[i]])
            started = True
        finally:
            if not started:  # the actors started so far go too, without hiding why the start failed
                try:
                    self.shutdown(cleanup)
                except (ray.exceptions.RayError, WorkerError) as exc:
                    logger.warning("after a failed start, ending the workers started failed: %s", exc)

    @property
    def dp_size(self) -> int:
        return len(self.workers)

    def call_all(self, method: Callable[..., Any], *args: Any) -> list[Any]:
        """Call ``method`` on every leader and wait; typed errors come back as themselves.
        (Which engines are in service is the replicas' business: ``Replicas.call``.)"""
        return self.get(self.submit(method, [args] * len(self.workers)))

    def submit(
        self,
        method: Callable[..., Any],
        args: Sequence[tuple[Any, ...]],
        engines: Sequence[int] | None = None,
    ) -> list[Any]:
        """Start ``method`` on every leader (or on ``engines``), leader i with ``args[i]``;
        returns the refs for ``get`` (given ``engines``, with their names)."""
        if len(args) != len(self.workers):
            raise ValueError(f"{len(args)} argument tuples for {len(self.workers)} workers")
        return [
            getattr(self.workers[i], method.__name__).remote(*args[i])
            for i in (range(len(self.workers)) if engines is None else engines)
        ]

    def restart(self, index: int, ready: Callable[..., Any]) -> Any:
        """End engine ``index``'s actor (its tied group goes with it) and start a new one on the
        same bundles. Returns the ref of its ``ready`` method's answer (which comes once it has
        started)."""
        ray.kill(self.workers[index], no_restart=True)
        self.workers[index] = self._builder.build(self._options[index], self.groups[index], index)
        return getattr(self.workers[index], ready.__name__).remote()

    def get(
        self, refs: list[Any], timeout_s: float | None = None, names: list[str] | None = None
    ) -> list[Any]:
        """The results of ``refs`` in order, naming the failing worker (``answers``): the first
        failure is raised as soon as it arrives, without waiting for the other workers."""
        results: list[Any] = [None] * len(refs)
        for n, result, error in self.answers(refs, names, timeout_s):
            if error is not None:
                raise error
            results[n] = result
        return results

    def answers(
        self, refs: list[Any], names: list[str] | None = None, timeout_s: float | None = None
    ) -> Iterator[tuple[int, Any, RollgenError | None]]:
        """Each answer to ``refs`` as it arrives: (its position, its result, None), or (its
        position, None, the error): a dead actor or a remote crash is a WorkerError naming the
        worker (``names[position]``) with the remote traceback; rollgen's own typed errors come
        as themselves. ``timeout_s``: a WorkerError for the workers that have not answered by
        then; None: ``call_timeout_s``, past which the workers that have not answered are killed
        as wedged (``WorkerError(died=True)``)."""
        names = names or self.names
        pending = {ref: n for n, ref in enumerate(refs)}
        wait_s = self.call_timeout_s if timeout_s is None else timeout_s
        deadline = None if wait_s is None else time.monotonic() + wait_s
        try:
            while pending:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                done, _ = ray.wait(list(pending), num_returns=1, timeout=left)
                if not done:
                    late = sorted(pending.values())
                    overdue = (
                        self.kill_wedged(
                            {names[n] for n in late}, f"did not answer within call_timeout_s={wait_s} s"
                        )
                        if timeout_s is None
                        else WorkerError(names[late[0]], f"did not answer within {wait_s} s")
                    )
                    for n in late:
                        yield n, None, overdue
                    return
                for ref in done:
                    n = pending.pop(ref)
                    result: Any = None
                    error: RollgenError | None = None
                    try:
                        result = self._result(ref, names[n])
                    except RollgenError as exc:
                        error = exc
                    yield n, result, error
        finally:
            for ref in pending:  # unanswered: their results, errors included, are taken when they come
                ref.future().add_done_callback(lambda f: f.exception())

    def kill_wedged(self, names: set[str], why: str) -> WorkerError:
        """Kill the workers ``names`` as wedged (``why``: what they did not do in time); their
        death (``WorkerError(died=True)``)."""
        wedged = [w for n, w in zip(self.names, self.workers) if n in names]
        logger.error("workers %s %s; killing them as wedged", sorted(names), why)
        for w in wedged:
            ray.kill(w, no_restart=True)
        return WorkerError(
            ", ".join(sorted(names)),
            f"{why} and was killed as wedged (the worker's log may say where it hung); create a new "
            "generation object",
            died=True,
        )

    @staticmethod
    def _result(ref: Any, name: str) -> Any:
        try:
            return ray.get(ref)
        except ray.exceptions.RayTaskError as exc:
            cause = getattr(exc, "cause", None)
            if isinstance(cause, RollgenError):
                raise cause from None
            raise WorkerError(
                name, f"raised {type(cause).__name__ if cause else 'an error'}: {cause}", str(exc)
            ) from None
        except ray.exceptions.RayActorError as exc:
            if not exc.actor_init_failed:
                raise WorkerError(
                    name,
                    f"died ({exc.__class__.__name__}; the worker's log says why, e.g. which engine "
                    "process ended); create a new generation object",
                    died=True,
                ) from exc
            # the constructor raised: Ray chains the creation task's error
            task = exc.__cause__ if isinstance(exc.__cause__, ray.exceptions.RayTaskError) else None
            cause = getattr(task, "cause", None)
            if isinstance(cause, RollgenError):
                raise cause from None
            what = f"{type(cause).__name__}: {cause}" if cause else str(exc).strip().splitlines()[-1]
            raise WorkerError(name, f"failed to start: {what}", str(task or exc)) from exc

    def shutdown(self, cleanup: Callable[..., Any] | None = None, timeout_s: float = 60.0) -> None:
        """Run ``cleanup`` on live leaders (best effort), then kill every actor and wait until Ray
        reports it dead (its process gone)."""
        if cleanup is not None:
            refs = [getattr(w, cleanup.__name__).remote() for w in self.workers]
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
            for ref in ready:
                try:
                    ray.get(ref)
                except ray.exceptions.RayActorError:
                    logger.debug("a worker was dead before its cleanup")
                except ray.exceptions.RayError as exc:
                    logger.warning("worker cleanup failed: %s", exc)
        for w in self.workers:
            ray.kill(w, no_restart=True)
        until_dead(self.workers, timeout_s)
        self.workers = []


def until_dead(actors: list[Any], timeout_s: float) -> None:
    """Return once a call to each of ``actors`` (killed) fails, as it does once Ray has seen its
    process exit, or after ``timeout_s``: ``ray.kill`` returns at once, and a call sent before
    the actor has taken the kill still runs on it."""
    deadline = time.monotonic() + timeout_s
    alive = list(actors)
    while alive and (left := deadline - time.monotonic()) > 0:
        calls = {a.__ray_ready__.remote(): a for a in alive}
        answered, _ = ray.wait(list(calls), num_returns=len(calls), timeout=left)
        alive = []
        for ref in answered:
            try:
                ray.get(ref)
            except ray.exceptions.RayError:
                continue  # dead
            alive.append(calls[ref])
        if alive:
            time.sleep(DEATH_POLL_S)
