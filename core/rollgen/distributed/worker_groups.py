"""Tied worker groups: TP consecutive bundles on one node, the leader actor owns the engine;
data parallelism is the number of tied groups."""

from __future__ import annotations

import importlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rollgen.distributed.virtual_cluster import RayVirtualCluster
from rollgen.errors import ConfigError, RollgenError, WorkerError

logger = logging.getLogger(__name__)


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
    """Creates one actor of ``cls_path`` ("module:Class") with the given constructor arguments."""

    def __init__(self, cls_path: str, *args: Any, **kwargs: Any) -> None:
        self.cls_path, self.args, self.kwargs = cls_path, args, kwargs

    def build(self, options: dict[str, Any], *extra_args: Any) -> Any:
        module, _, name = self.cls_path.partition(":")
        cls = getattr(importlib.import_module(module), name)
        return ray.remote(cls).options(**options).remote(*self.args, *extra_args, **self.kwargs)


class RayWorkerGroup:
    """One leader actor per tied group, placed on the group's first bundle."""

    def __init__(
        self,
        cluster: RayVirtualCluster,
        builder: RayWorkerBuilder,
        tp_size: int,
        name_prefix: str = "rollgen",
        env_vars: dict[str, str] | None = None,
        leader_resources: dict[str, float] | None = None,
        per_group_env: list[dict[str, str]] | None = None,
    ) -> None:
        self.cluster = cluster
        self.groups = tied_groups(cluster.bundles_per_node, tp_size)
        self.names = [f"{name_prefix}-dp{i}" for i in range(len(self.groups))]
        self.workers: list[Any] = []
        pgs = cluster.get_placement_groups()
        resources = leader_resources or {"num_cpus": cluster.cpus_per_bundle / 2}
        for i, group in enumerate(self.groups):
            env = {**(env_vars or {}), **(per_group_env[i] if per_group_env else {})}
            options = {
                "scheduling_strategy": PlacementGroupSchedulingStrategy(
                    placement_group=pgs[group.node],
                    placement_group_bundle_index=group.bundle_indices[0],
                    placement_group_capture_child_tasks=True,
                ),
                "runtime_env": {"env_vars": env},
                "max_concurrency": 1,
                **resources,
            }
            self.workers.append(builder.build(options, group, i))

    @property
    def dp_size(self) -> int:
        return len(self.workers)

    def call_all(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Call ``method`` on every leader and wait; typed errors come back as themselves."""
        return self.get([getattr(w, method).remote(*args, **kwargs) for w in self.workers])

    def call_sharded(self, method: str, shards: Sequence[Any], **kwargs: Any) -> list[Any]:
        """Leader i gets ``shards[i]``; empty shards are not sent. Results in shard order."""
        if len(shards) != len(self.workers):
            raise ValueError(f"{len(shards)} shards for {len(self.workers)} workers")
        live = [i for i, s in enumerate(shards) if len(s) and getattr(s, "size", 1)]
        refs = [getattr(self.workers[i], method).remote(shards[i], **kwargs) for i in live]
        return self.get(refs, names=[self.names[i] for i in live])

    def get(
        self, refs: list[Any], timeout_s: float | None = None, names: list[str] | None = None
    ) -> list[Any]:
        """ray.get that names the failing worker: a dead actor or a remote crash becomes a
        WorkerError with the remote traceback; rollgen's own typed errors pass through."""
        results = []
        for name, ref in zip(names or self.names, refs):
            try:
                results.append(ray.get(ref, timeout=timeout_s))
            except ray.exceptions.RayTaskError as exc:
                cause = getattr(exc, "cause", None)
                if isinstance(cause, RollgenError):
                    raise cause from None
                raise WorkerError(
                    name, f"raised {type(cause).__name__ if cause else 'an error'}: {cause}", str(exc)
                ) from None
            except ray.exceptions.RayActorError as exc:
                raise WorkerError(
                    name, f"died ({exc.__class__.__name__}); create a new generation object"
                ) from exc
            except ray.exceptions.GetTimeoutError as exc:
                raise WorkerError(name, f"did not answer within {timeout_s} s") from exc
        return results

    def shutdown(self, cleanup_method: str | None = "shutdown", timeout_s: float = 60.0) -> None:
        """Run ``cleanup_method`` on live leaders (best effort), then kill every actor."""
        if cleanup_method:
            refs = [getattr(w, cleanup_method).remote() for w in self.workers]
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
            for ref in ready:
                try:
                    ray.get(ref)
                except ray.exceptions.RayError as exc:
                    logger.warning("worker cleanup failed: %s", exc)
        for w in self.workers:
            ray.kill(w, no_restart=True)
        self.workers = []
