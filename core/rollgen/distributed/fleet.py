"""The replicas of a ``RayGeneration`` and what the death of one does (``engine_failures``).

"fail" (the default): the death ends the generation, as ``serialised`` records it. "replace":
the dead replica is taken out of service (its actor, and the engine processes under it, are
killed as a unit) and a new actor is started on its bundles at once, in the background (Ray
starts it while the driver goes on). The samples it held are re-run on the surviving replicas
(``Fleet.generate``; streamed ones by the dispatcher). A new replica is STALE until it holds the
generation's current weight version: at the next ``generate`` or ``submit`` after it reported
ready (or ``RayGeneration.restore_replicas``), it is sent the weights the fleet keeps
(``RetainedWeights``: the latest value of every tensor an update from this process sent) and
only then serves. Updates made while it started count, since the fleet keeps the latest ones;
an update that came over a weight-sync group cannot be retained (a new engine cannot join a
group of fixed size), so a replica that would need it stays out, with the reason, until a
complete update from this process or over a new group (``sync_members``: every replica joins
it, a replacement too)."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, cast

import ray
import torch

from rollgen.data import BatchedDataDict
from rollgen.distributed.worker import EngineWorker, GenerateRequest
from rollgen.errors import RefitError, WorkerError
from rollgen.refit.bucket import WeightBucket, grouped, pack_bucket
from rollgen.refit.meta import Transport
from rollgen.refit.transports import transport_named
from rollgen.sampling import SampleParams

if TYPE_CHECKING:
    from rollgen.distributed.generation import RayGeneration
    from rollgen.distributed.refit_link import RayLink

logger = logging.getLogger(__name__)

ReplicaState = Literal["starting", "stale", "healthy", "dead"]
#: The largest bucket a catch-up sends a new replica.
CATCH_UP_BUCKET_BYTES = 1 << 30


@dataclass(frozen=True)
class ReplicaStatus:
    """One replica as ``gen.replicas`` reports it. ``weight_version``: the version it holds
    (None while starting); ``in_flight``: samples it is running; ``restarts``: replacements so
    far; ``last_error``: why it last died, or why it stays out."""

    index: int
    name: str
    state: ReplicaState
    weight_version: int | None
    in_flight: int
    restarts: int
    last_error: str | None


@dataclass
class _Replica:
    state: ReplicaState = "healthy"
    version: int | None = 0
    in_flight: int = 0
    restarts: int = 0
    last_error: str | None = None
    #: When it was replaced, within the restart window.
    restarted_at: deque[float] = field(default_factory=deque)
    #: The ref of a starting replacement's ``ready`` answer.
    ready: Any = None


class RetainedWeights:
    """A host copy of the latest value of every tensor updated from this process, and the
    weight version that makes it current; ``missing``: why it is not (an update over a
    weight-sync group), until a complete update from this process."""

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self.version = 0
        self.missing: str | None = None

    def keep(self, named: Iterable[tuple[str, torch.Tensor]], partial: bool, version: int) -> None:
        """Retain an update that completed as ``version``."""
        copies = {n: t.detach().to("cpu", copy=True) for n, t in named}
        if partial:
            self.tensors.update(copies)
        else:
            self.tensors, self.missing = copies, None
        self.version = version

    def lose(self, why: str, version: int) -> None:
        """An update (now ``version``) that could not be retained."""
        self.missing, self.version = why, version

    def why_not_current(self, version: int) -> str | None:
        """Why these weights cannot bring a new replica to ``version`` (None: they can)."""
        if self.missing is not None:
            return self.missing
        if self.version != version:
            return f"the fleet kept weight version {self.version}, the generation is at {version}"
        return None

    def buckets(self, transport: Transport) -> list[WeightBucket]:
        """The retained tensors packed for ``transport`` (none: the start-up weights are current)."""
        named = list(self.tensors.items())
        groups = grouped(named, CATCH_UP_BUCKET_BYTES, None)
        return [pack_bucket([named[i] for i in g], transport, check_finite=False) for g in groups]


class Fleet:
    """The replicas of ``gen`` (its worker group's engines) and the ``engine_failures`` policy
    from its engine config. Its methods run under the generation's lock, except ``died``,
    which the dispatcher's thread calls too (the fleet's own lock orders them)."""

    def __init__(self, gen: RayGeneration, engine: Mapping[str, Any]) -> None:
        self.gen = gen
        self.replaces = engine["engine_failures"] == "replace"
        self.max_restarts, self.window_s = int(engine["max_restarts"]), float(engine["restart_window_s"])
        self.replicas = [_Replica() for _ in gen.group.workers]
        self.weights = RetainedWeights()
        #: The members of the current weight-sync group: replica index -> its restarts then.
        self._sync: dict[int, int] = {}
        self._lock = threading.RLock()

    @property
    def _link(self) -> RayLink:
        return cast("RayLink", self.gen.updates.link)

    def status(self) -> list[ReplicaStatus]:
        names = self.gen.group.names
        load = [r.running for r in self.gen._dispatcher.load()]
        return [
            ReplicaStatus(i, names[i], r.state, r.version, r.in_flight + load[i], r.restarts, r.last_error)
            for i, r in enumerate(self.replicas)
        ]

    def _move(self, index: int, state: ReplicaState, why: str = "") -> None:
        replica = self.replicas[index]
        log = logger.warning if state == "dead" else logger.info
        log(
            "%s: replica %s %s -> %s%s",
            self.gen.name,
            self.gen.group.names[index],
            replica.state,
            state,
            f" ({why})" if why else "",
        )
        replica.state = state

    # ---- deaths ---------------------------------------------------------------------------------
    def died(self, index: int, error: WorkerError) -> bool:
        """Replica ``index`` died (``error``): with "replace", take it out of service and
        replace it. Whether the generation goes on (a replica is still in service)."""
        if not self.replaces:
            return False
        with self._lock:
            group = self.gen.group
            if index in group.out:  # its death was seen already
                return bool(group.live)
            group.out.add(index)
            replica = self.replicas[index]
            replica.version, replica.in_flight = None, 0
            replica.last_error = str(error).splitlines()[0]
            self._move(index, "dead", replica.last_error)
            self._link.drop(index)
            self.gen._dispatcher.take_out(index)
            self._replace(index)
            return bool(group.live)

    def died_as(self, error: WorkerError) -> bool:
        """``died`` for each replica ``error`` names (as workers, ", "-separated, or as one of
        a worker's ranks); False where it names none."""
        named = error.worker.split(", ")
        found = [
            i
            for i, n in enumerate(self.gen.group.names)
            if any(w == n or w.startswith(f"{n} ") for w in named)
        ]
        survived = [self.died(i, error) for i in found]
        return bool(survived) and all(survived)

    def _replace(self, index: int) -> None:
        """Start a new actor for replica ``index`` (out of service), unless it reached the
        restart limit."""
        replica, now = self.replicas[index], time.monotonic()
        while replica.restarted_at and now - replica.restarted_at[0] > self.window_s:
            replica.restarted_at.popleft()
        if len(replica.restarted_at) >= self.max_restarts:
            replica.last_error = (
                f"{replica.last_error}; replaced {self.max_restarts} time(s) within {self.window_s:.0f} s "
                "(max_restarts, restart_window_s): it stays out"
            )
            logger.error(
                "%s: replica %s stays out: %s", self.gen.name, self.gen.group.names[index], replica.last_error
            )
            return
        replica.restarted_at.append(now)
        replica.restarts += 1
        replica.ready = self.gen.group.restart(index, EngineWorker.ready)
        self._move(index, "starting", f"replacement {replica.restarts}")

    # ---- admission ------------------------------------------------------------------------------
    def admit(self, timeout_s: float | None = 0.0) -> None:
        """Bring every replica that started (waiting up to ``timeout_s`` for those starting;
        None: until they answer) to the current weights and put it in service; one that cannot
        be brought there stays out with the reason."""
        with self._lock:
            starting = [r.ready for r in self.replicas if r.state == "starting"]
            if starting and timeout_s != 0.0:
                ray.wait(starting, num_returns=len(starting), timeout=timeout_s)
            for index, replica in enumerate(self.replicas):
                if replica.state == "starting":
                    self._started(index)
                if replica.state == "stale":
                    self._catch_up(index)

    def _started(self, index: int) -> None:
        replica, group = self.replicas[index], self.gen.group
        if not ray.wait([replica.ready], timeout=0)[0]:
            return
        ref, replica.ready = replica.ready, None
        try:
            info = group.get([ref], names=[group.names[index]])[0]
        except WorkerError as exc:
            replica.last_error = f"the replacement failed to start: {exc}"
            self._move(index, "dead", replica.last_error)
            self._replace(index)
            return
        self.gen.engine_info[index] = info
        self._move(index, "stale", "started; not yet at the current weights")

    def _catch_up(self, index: int) -> None:
        replica, version = self.replicas[index], self.gen.weight_version
        why = self.weights.why_not_current(version)
        if why is not None:
            if replica.last_error != why:
                replica.last_error = why
                logger.error("%s: replica %s stays out: %s", self.gen.name, self.gen.group.names[index], why)
            return
        try:  # packed for the engines' transport of host tensors
            self._link.adopt(index, self.weights.buckets(transport_named(self.gen.local_transport).host))
        except WorkerError as exc:
            replica.last_error = f"bringing it to weight version {version} failed: {exc}"
            self._move(index, "dead", replica.last_error)
            if exc.died:
                self._replace(index)
            return
        self._serve(index, version)

    def _serve(self, index: int, version: int) -> None:
        """Put replica ``index``, now at weight ``version``, in service."""
        self.replicas[index].version = version
        self.gen.group.out.discard(index)
        self.gen._dispatcher.reopen(index, int(self.gen.engine_info[index]["capacity"]))
        self._move(index, "healthy", f"at weight version {version}")

    # ---- the weight-sync group ------------------------------------------------------------------
    def sync_members(self, timeout_s: float) -> dict[int, int]:
        """The replicas that join a new weight-sync group: every one, a replacement still
        starting waited for up to ``timeout_s`` (a group's size is fixed): index -> its restarts
        now, recorded as the group's members once ``joined``.

        Raises:
            RefitError: a replica is not running (it stays out, or did not start in time)."""
        with self._lock:
            if any(r.state == "starting" for r in self.replicas):
                self.admit(timeout_s)
            names = self.gen.group.names
            missing = [
                f"{names[i]} ({r.state}: {r.last_error})"
                for i, r in enumerate(self.replicas)
                if r.state not in ("healthy", "stale")
            ]
            if missing:
                raise RefitError(
                    f"{self.gen.name}: a weight-sync group needs every replica, and {', '.join(missing)} "
                    "is not running; call gen.restore_replicas(timeout_s) and make the group again, or "
                    "refit from this process"
                )
            return {i: r.restarts for i, r in enumerate(self.replicas)}

    def joined(self, members: dict[int, int]) -> None:
        """``members`` (from ``sync_members``) formed the current weight-sync group."""
        self._sync = dict(members)

    def sync_submit(
        self, method: Callable[..., Any], args: list[tuple[Any, ...]]
    ) -> tuple[list[Any], list[str]]:
        """Start ``method`` on every member of the current weight-sync group (a stale one too:
        each takes part in every update); its refs and the members' names, for ``group.get``.

        Raises:
            RefitError: a member died since the group formed (nothing is started)."""
        names = self.gen.group.names
        with self._lock:  # no replica replaced between the check and the calls
            lost = [
                names[i]
                for i, restarts in self._sync.items()
                if self.replicas[i].restarts != restarts or self.replicas[i].state in ("dead", "starting")
            ]
            if lost:
                raise RefitError(
                    f"{self.gen.name}: {', '.join(lost)} died since the weight-sync group formed, and a "
                    "group's size is fixed: make a new group (a new WeightSender, then gen.init_weight_sync "
                    "with its spec: every replica joins it, a replacement too) and send a complete update "
                    "over it"
                )
            members = sorted(self._sync)
            return self.gen.group.submit(method, args, members), [names[i] for i in members]

    # ---- updates --------------------------------------------------------------------------------
    def updated(self, named: Iterable[tuple[str, torch.Tensor]] | None, partial: bool) -> None:
        """An update completed: the replicas in service hold the new version; ``named``: its
        tensors, which a replacement will need (None: they came over a weight-sync group)."""
        version = self.gen.weight_version
        for index in self.gen.group.live:
            self.replicas[index].version = version
        if not self.replaces:
            return
        if named is None and not partial:  # a complete update reached every member, stale ones too
            with self._lock:
                for index in self._sync:
                    if self.replicas[index].state == "stale":
                        self._serve(index, version)
        if named is None:
            self.weights.lose(
                f"weight version {version} came over a weight-sync group, which a new engine cannot join",
                version,
            )
        else:
            self.weights.keep(named, partial, version)

    # ---- generate -------------------------------------------------------------------------------
    def generate(self, batch: BatchedDataDict[Any], params: list[SampleParams]) -> list[BatchedDataDict[Any]]:
        """``batch`` sharded over the replicas in service; a shard whose replica dies is re-run
        on a survivor (its samples keep their settings and seeds). Outputs in shard order."""
        self.admit()
        group = self.gen.group
        shards = GenerateRequest.shards(batch, params, len(group.live))
        results: list[BatchedDataDict[Any] | None] = [None] * len(shards)
        todo = [k for k, s in enumerate(shards) if len(s)]
        while todo:
            live = group.live
            calls = []
            for n, k in enumerate(todo):
                index = live[n % len(live)]
                self.replicas[index].in_flight += len(shards[k])
                calls.append((k, index, group.workers[index].generate.remote(shards[k])))
            todo = []
            for k, index, ref in calls:
                try:
                    results[k] = group.get([ref], names=[group.names[index]])[0]
                except WorkerError as exc:
                    if not (exc.died and self.died(index, exc)):
                        raise
                    logger.warning(
                        "%s: re-running %d sample(s) of %s", self.gen.name, len(shards[k]), exc.worker
                    )
                    todo.append(k)
                finally:
                    self.replicas[index].in_flight = max(0, self.replicas[index].in_flight - len(shards[k]))
        return [r for r in results if r is not None]
