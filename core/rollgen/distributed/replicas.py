"""``Replicas``: the one owner of a ``RayGeneration``'s engines — the worker group, what each
engine reported of itself, and the replica table (state, weight version, samples in flight,
restarts, last error). Whether replica *i* is in service is its state here, and nowhere else:
it serves while ``healthy``.

The dispatcher, the Ray refit link and the replacement policy (``rollgen.distributed.fleet``)
are each handed the replicas; they listen (``ReplicaListener``) for a replica that leaves service
(it died, or failed) or returns to it (a replacement that caught up). A death is the replicas'
to record (``died``); with ``replaces`` the generation outlives it (the policy, told, starts a
replacement), else it ends the generation, as ``serialised`` records it.

What a dead engine held that its processes' end does not free — the shared memory in
``/dev/shm`` its processes made (vLLM's message queues and locks), which nothing unlinks once
they are killed — is reclaimed here once every process of it has exited: when its replacement
is admitted, and at shutdown."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from rollgen.data import BatchedDataDict
from rollgen.distributed.worker import EngineWorker, GenerateRequest
from rollgen.distributed.worker_groups import RayWorkerGroup
from rollgen.errors import RefitError, RollgenError, WorkerError
from rollgen.processes import running, unlink_shared_memory, wait_for_exit
from rollgen.sampling import SampleParams

logger = logging.getLogger(__name__)

ReplicaState = Literal["starting", "stale", "healthy", "dead"]


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
class Replica:
    """A row of the replica table. ``info``: what its engine reported once started
    (``EngineWorker.ready``); ``ready``: the ref of a starting replacement's answer."""

    info: dict[str, Any]
    state: ReplicaState = "healthy"
    version: int | None = 0
    in_flight: int = 0
    restarts: int = 0
    last_error: str | None = None
    ready: Any = None


class ReplicaListener(Protocol):
    """Told, under the replicas' lock, when a replica leaves service or returns to it."""

    def replica_left(self, index: int) -> None:
        """Replica ``index`` is out of service (dead): nothing more goes to it."""
        ...

    def replica_returned(self, index: int) -> None:
        """Replica ``index`` (a new engine) is in service again."""
        ...


@dataclass(frozen=True)
class Leftovers:
    """What a dead engine held that its processes' end does not free: ``shared_memory`` (name
    -> inode) on ``node``, to unlink once its processes ``pids`` are gone."""

    node: str
    pids: tuple[int, ...]
    shared_memory: dict[str, int]

    @classmethod
    def of(cls, info: dict[str, Any]) -> Leftovers:
        return cls(info["node"], tuple(info.get("pids", (info["pid"],))), dict(info.get("shared_memory", {})))


@ray.remote(num_cpus=0)
def _reclaim_there(pids: tuple[int, ...], segments: dict[str, int]) -> bool:
    """``Leftovers.reclaim`` on the engine's node."""
    if any(running(p) for p in pids):
        return False
    unlink_shared_memory(segments)
    return True


class Replicas:
    """The engines of ``group`` (started: each has answered ``EngineWorker.ready``) and their
    table. ``replaces``: a death the others survive leaves the generation going
    (``engine_failures: "replace"``)."""

    def __init__(self, group: RayWorkerGroup, name: str, replaces: bool) -> None:
        self.group, self.name, self.replaces = group, name, replaces
        self.table = [Replica(info) for info in group.call_all(EngineWorker.ready)]
        #: One lock for the table and its listeners (the dispatcher's thread meets deaths too).
        self.lock = threading.RLock()
        self._listeners: list[ReplicaListener] = []
        #: The members of the current weight-sync group: replica index -> its restarts then.
        self._sync: dict[int, int] = {}
        #: What dead engines left behind, until their processes are gone.
        self._leftovers: list[Leftovers] = []

    def listen(self, listener: ReplicaListener) -> None:
        """Tell ``listener`` when a replica leaves service or returns (listeners in order)."""
        self._listeners.append(listener)

    # ---- the table ------------------------------------------------------------------------------
    @property
    def names(self) -> list[str]:
        return self.group.names

    def __len__(self) -> int:
        return len(self.table)

    def info(self, index: int) -> dict[str, Any]:
        """What replica ``index``'s engine reported once started."""
        return self.table[index].info

    def in_service(self, index: int) -> bool:
        return self.table[index].state == "healthy"

    @property
    def live(self) -> list[int]:
        """The replicas in service, in order."""
        return [i for i, r in enumerate(self.table) if r.state == "healthy"]

    def status(self, running: Sequence[int]) -> list[ReplicaStatus]:
        """Each replica's row; ``running``: each one's streamed samples (the dispatcher's)."""
        return [
            ReplicaStatus(
                i, self.names[i], r.state, r.version, r.in_flight + running[i], r.restarts, r.last_error
            )
            for i, r in enumerate(self.table)
        ]

    def _move(self, index: int, state: ReplicaState, why: str = "") -> None:
        replica = self.table[index]
        log = logger.warning if state == "dead" else logger.info
        log(
            "%s: replica %s %s -> %s%s",
            self.name,
            self.names[index],
            replica.state,
            state,
            f" ({why})" if why else "",
        )
        replica.state = state

    def stays_out(self, index: int, why: str) -> None:
        """Replica ``index`` (out of service) stays out, for ``why``."""
        with self.lock:
            if self.table[index].last_error != why:
                self.table[index].last_error = why
                logger.error("%s: replica %s stays out: %s", self.name, self.names[index], why)

    # ---- calls ----------------------------------------------------------------------------------
    def call(self, method: Callable[..., Any], *args: Any) -> list[Any]:
        """``method(*args)`` on every replica in service, and wait; results in replica order."""
        live = self.live
        refs = self.group.submit(method, [args] * len(self.table), live)
        return self.group.get(refs, names=[self.names[i] for i in live])

    def submit(
        self, method: Callable[..., Any], args: Sequence[tuple[Any, ...]]
    ) -> tuple[list[Any], list[str]]:
        """Start ``method`` on every replica in service, replica i with ``args[i]``; the refs
        and the replicas' names, for ``group.get``."""
        live = self.live
        return self.group.submit(method, args, live), [self.names[i] for i in live]

    def shard(self, batch: BatchedDataDict[Any], params: list[SampleParams]) -> list[BatchedDataDict[Any]]:
        """``batch`` sharded over the replicas in service (uneven shards allowed, empty ones not
        sent); outputs in shard order. A shard whose replica dies is run again on a survivor
        (its samples keep their settings and seeds) where the generation outlives the death
        (``died``); otherwise its error is raised, as soon as it arrives."""
        shards = GenerateRequest.shards(batch, params, len(self._serving()))
        results: list[BatchedDataDict[Any] | None] = [None] * len(shards)
        todo = [k for k, s in enumerate(shards) if len(s)]
        while todo:
            live = self._serving()
            calls = [(k, live[n % len(live)]) for n, k in enumerate(todo)]
            refs = []
            for k, index in calls:
                self.table[index].in_flight += len(shards[k])
                refs.append(self.group.workers[index].generate.remote(shards[k]))
            todo, open_calls = [], dict(enumerate(calls))
            try:
                for n, result, error in self.group.answers(refs, [self.names[i] for _, i in calls]):
                    k, index = open_calls.pop(n)
                    self._done(index, len(shards[k]))
                    if error is None:
                        results[k] = result
                    elif isinstance(error, WorkerError) and error.died and self.died(index, error):
                        logger.warning(
                            "%s: re-running %d sample(s) of %s", self.name, len(shards[k]), error.worker
                        )
                        todo.append(k)
                    else:
                        raise error
            finally:
                for k, index in open_calls.values():
                    self._done(index, len(shards[k]))
        return [r for r in results if r is not None]

    def _serving(self) -> list[int]:
        live = self.live
        if not live:
            raise WorkerError(
                ", ".join(self.names), "no replica is in service; create a new generation object", died=True
            )
        return live

    def _done(self, index: int, samples: int) -> None:
        replica = self.table[index]
        replica.in_flight = max(0, replica.in_flight - samples)

    # ---- leaving and returning ------------------------------------------------------------------
    def died(self, index: int, error: WorkerError) -> bool:
        """Replica ``index`` died (``error``): it is out of service. Whether the generation goes
        on: with ``replaces``, while a replica is still in service (its listeners are told);
        without, the death ends the generation (nothing is moved: the caller fails what the
        replica held)."""
        if not self.replaces:
            with self.lock:
                self._dead(index, error)
            return False
        self.take_out(index, error)
        with self.lock:
            return bool(self.live)

    def died_as(self, error: WorkerError) -> bool:
        """``died`` for each replica ``error`` names (as workers, ", "-separated, or as one of
        a worker's ranks); False where it names none."""
        named = error.worker.split(", ")
        found = [i for i, n in enumerate(self.names) if any(w == n or w.startswith(f"{n} ") for w in named)]
        survived = [self.died(i, error) for i in found]
        return bool(survived) and all(survived)

    def take_out(self, index: int, error: RollgenError | str) -> None:
        """Replica ``index`` failed (``error``): out of service, its listeners told (once)."""
        with self.lock:
            if self.table[index].state not in ("dead", "starting"):  # not seen already, or replaced
                self._leave(index, error)

    def _dead(self, index: int, error: RollgenError | str) -> None:
        """Mark replica ``index`` dead for ``error`` (unless it is dead or starting already),
        its listeners not told: the generation ends with it."""
        if self.table[index].state not in ("dead", "starting"):
            self._mark(index, error)

    def _leave(self, index: int, error: RollgenError | str) -> None:
        """Replica ``index`` is dead for ``error``; its listeners are told."""
        self._mark(index, error)
        for listener in self._listeners:
            listener.replica_left(index)

    def _mark(self, index: int, error: RollgenError | str) -> None:
        replica = self.table[index]
        replica.version, replica.in_flight = None, 0
        replica.last_error = str(error).splitlines()[0]
        self._move(index, "dead", replica.last_error)

    def restart(self, index: int, why: str) -> None:
        """End replica ``index``'s actor (out of service; its tied group goes with it) and start
        a new one on the same bundles: it is ``starting`` until ``started`` finds it up."""
        with self.lock:
            replica = self.table[index]
            self._leftovers.append(Leftovers.of(replica.info))
            replica.ready = self.group.restart(index, EngineWorker.ready)
            replica.restarts += 1
            self._move(index, "starting", why)

    def started(self, timeout_s: float | None = 0.0) -> None:
        """Wait up to ``timeout_s`` (None: until they answer) for the replacements starting;
        each that started is ``stale`` (out of service, not yet at the current weights), each
        whose start failed is ``dead`` (its listeners told). Once one started, what dead engines
        left is reclaimed (their processes, killed before it started, waited for)."""
        with self.lock:
            up = False
            starting = [r.ready for r in self.table if r.state == "starting"]
            if starting and timeout_s != 0.0:
                ray.wait(starting, num_returns=len(starting), timeout=timeout_s)
            for index, replica in enumerate(self.table):
                if replica.state != "starting" or not ray.wait([replica.ready], timeout=0)[0]:
                    continue
                ref, replica.ready = replica.ready, None
                try:
                    replica.info = self.group.get([ref], names=[self.names[index]])[0]
                except WorkerError as exc:
                    self._leave(index, f"the replacement failed to start: {exc}")
                    continue
                self._move(index, "stale", "started; not yet at the current weights")
                up = True
            if up:
                here = ray.get_runtime_context().get_node_id()
                wait_for_exit([p for left in self._leftovers if left.node == here for p in left.pids])
                self.reclaim()

    def serve(self, index: int, version: int) -> None:
        """Put replica ``index``, now at weight ``version``, in service (its listeners told)."""
        with self.lock:
            self.table[index].version = version
            self._move(index, "healthy", f"at weight version {version}")
            for listener in self._listeners:
                listener.replica_returned(index)

    def updated(self, version: int) -> None:
        """An update completed: the replicas in service hold ``version``."""
        with self.lock:
            for index in self.live:
                self.table[index].version = version

    # ---- the weight-sync group ------------------------------------------------------------------
    def sync_members(self, timeout_s: float) -> dict[int, int]:
        """The replicas that join a new weight-sync group: every one, a replacement still
        starting waited for up to ``timeout_s`` (a group's size is fixed): index -> its restarts
        now, recorded as the group's members once ``joined``.

        Raises:
            RefitError: a replica is not running (it stays out, or did not start in time)."""
        with self.lock:
            if any(r.state == "starting" for r in self.table):
                self.started(timeout_s)
            missing = [
                f"{self.names[i]} ({r.state}: {r.last_error})"
                for i, r in enumerate(self.table)
                if r.state not in ("healthy", "stale")
            ]
            if missing:
                raise RefitError(
                    f"{self.name}: a weight-sync group needs every replica, and {', '.join(missing)} "
                    "is not running; call gen.restore_replicas(timeout_s) and make the group again, or "
                    "refit from this process"
                )
            return {i: r.restarts for i, r in enumerate(self.table)}

    def joined(self, members: dict[int, int]) -> None:
        """``members`` (from ``sync_members``) formed the current weight-sync group."""
        with self.lock:
            self._sync = dict(members)

    @property
    def sync_group(self) -> list[int]:
        """The members of the current weight-sync group."""
        return sorted(self._sync)

    def sync_submit(
        self, method: Callable[..., Any], args: list[tuple[Any, ...]]
    ) -> tuple[list[Any], list[str]]:
        """Start ``method`` on every member of the current weight-sync group (a stale one too:
        each takes part in every update); its refs and the members' names, for ``group.get``.

        Raises:
            RefitError: a member died since the group formed (nothing is started)."""
        with self.lock:  # no replica replaced between the check and the calls
            lost = [
                self.names[i]
                for i, restarts in self._sync.items()
                if self.table[i].restarts != restarts or self.table[i].state in ("dead", "starting")
            ]
            if lost:
                raise RefitError(
                    f"{self.name}: {', '.join(lost)} died since the weight-sync group formed, and a "
                    "group's size is fixed: make a new group (a new WeightSender, then gen.init_weight_sync "
                    "with its spec: every replica joins it, a replacement too) and send a complete update "
                    "over it"
                )
            members = sorted(self._sync)
            return self.group.submit(method, args, members), [self.names[i] for i in members]

    # ---- what dead engines leave ----------------------------------------------------------------
    def reclaim(self) -> None:
        """Unlink the shared memory of dead engines whose processes are all gone (on their
        node); the others are kept for a later look."""
        here = ray.get_runtime_context().get_node_id()
        kept = []
        for left in self._leftovers:
            if not left.shared_memory:
                continue
            if left.node == here:
                done = not any(running(p) for p in left.pids)
                if done:
                    unlink_shared_memory(left.shared_memory)
            else:
                strategy = NodeAffinitySchedulingStrategy(left.node, soft=False)
                task = _reclaim_there.options(scheduling_strategy=strategy)
                done = bool(ray.get(task.remote(left.pids, left.shared_memory), timeout=60))
            if not done:
                kept.append(left)
        self._leftovers = kept

    @property
    def leftovers(self) -> list[Leftovers]:
        """What dead engines left that is not reclaimed yet."""
        return list(self._leftovers)

    def shutdown(self, cleanup: Callable[..., Any], timeout_s: float) -> None:
        """End every engine (``cleanup`` first, as ``RayWorkerGroup.shutdown`` takes it), wait
        until the processes of those on this node are gone, and reclaim what they left."""
        self.group.shutdown(cleanup, timeout_s)
        here = ray.get_runtime_context().get_node_id()
        with self.lock:
            self._leftovers += [Leftovers.of(r.info) for r in self.table if r.ready is None]
            wait_for_exit([p for left in self._leftovers if left.node == here for p in left.pids])
            self.reclaim()
