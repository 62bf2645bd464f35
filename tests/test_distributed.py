"""Ray orchestration on real Ray: tied groups, a simulated two-node cluster, worker faults."""

import threading
import time
from typing import Any

import pytest
import ray
import torch

from rollgen import BatchedDataDict, ConfigError, InputError, WorkerError
from rollgen.distributed import RayVirtualCluster, RayWorkerBuilder, RayWorkerGroup
from rollgen.distributed.worker_groups import TiedGroup, tied_groups, until_dead
from rollgen.testing.probe import ProbeWorker
from tests.waiting import SAFETY_S

PROBE = "rollgen.testing.probe:ProbeWorker"


def test_tied_groups_are_consecutive_bundles_on_one_node() -> None:
    assert tied_groups([4, 2], 2) == [TiedGroup(0, (0, 1)), TiedGroup(0, (2, 3)), TiedGroup(1, (0, 1))]
    assert tied_groups([3], 2) == [TiedGroup(0, (0, 1))]
    with pytest.raises(ConfigError, match="no tensor-parallel group of 4 fits"):
        tied_groups([2, 2], 4)


@pytest.fixture
def two_node_cluster():
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "num_gpus": 0})
    nodes = [cluster.add_node(num_cpus=1, num_gpus=2) for _ in range(2)]
    ray.init(address=cluster.address, include_dashboard=False)
    yield nodes
    ray.shutdown()
    cluster.shutdown()


def test_bundles_across_two_simulated_nodes(two_node_cluster) -> None:
    vc = RayVirtualCluster([2, 2], use_gpus=True, cpus_per_bundle=0.25)
    try:
        pg_nodes = vc.node_ids()
        assert len(set(pg_nodes)) == 2, "one placement group per node"
        group = RayWorkerGroup(
            vc,
            RayWorkerBuilder(PROBE, lambda group, i: ("t", group, i)),
            tp_size=2,
            leader_resources={"num_cpus": 0.1, "num_gpus": 0},
        )
        where = group.call_all(ProbeWorker.where)
        assert [w["bundles"] for w in where] == [(0, 1), (0, 1)]
        assert [w["node"] for w in where] == pg_nodes
        group.shutdown()
        single = RayWorkerGroup(
            vc,
            RayWorkerBuilder(PROBE, lambda group, i: ("t", group, i)),
            tp_size=1,
            leader_resources={"num_cpus": 0.1, "num_gpus": 0.5},
        )
        assert single.dp_size == 4
        assert [w["bundles"] for w in single.call_all(ProbeWorker.where)] == [(0,), (1,), (0,), (1,)]
        single.shutdown()
    finally:
        vc.shutdown()
    assert all(pg["state"] == "REMOVED" for pg in ray.util.placement_group_table().values())


@pytest.fixture
def probes():
    if ray.is_initialized():
        ray.shutdown()
    vc = RayVirtualCluster([2], use_gpus=False, cpus_per_bundle=0.5)
    group = RayWorkerGroup(
        vc,
        RayWorkerBuilder(PROBE, lambda group, i: ("t", group, i)),
        tp_size=1,
        leader_resources={"num_cpus": 0.25},
    )
    yield group
    group.shutdown()
    vc.shutdown()
    ray.shutdown()


def test_workers_that_may_share_a_gpu_start_one_at_a_time() -> None:
    """Engines sharing a GPU start one after another (``one_at_a_time``: each sizes its memory
    from the device's free memory); a start that fails ends the workers started before it."""
    from rollgen.testing.probe import StartCounter

    if ray.is_initialized():
        ray.shutdown()
    vc = RayVirtualCluster([3], use_gpus=False, cpus_per_bundle=0.5)
    try:
        counter = ray.remote(StartCounter).options(name="starts", num_cpus=0).remote()
        group = RayWorkerGroup(
            vc,
            RayWorkerBuilder(PROBE, lambda group, i: ("starts:starts", group, i)),
            tp_size=1,
            leader_resources={"num_cpus": 0.25},
            one_at_a_time=True,
        )
        assert [w["index"] for w in group.call_all(ProbeWorker.where)] == [0, 1, 2]
        assert ray.get(counter.most_at_once.remote()) == 1
        group.shutdown()
        with pytest.raises(WorkerError, match="dp1: failed to start"):
            RayWorkerGroup(
                vc,
                RayWorkerBuilder(PROBE, lambda group, i: ("fail-start:starts", group, i)),
                tp_size=1,
                leader_resources={"num_cpus": 0.25},
                one_at_a_time=True,
            )
        (first,) = ray.get(counter.handles.remote())  # the probe that started before the failure
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(first.where.remote())
    finally:
        vc.shutdown()
        ray.shutdown()


def _killed(group: RayWorkerGroup, index: int) -> None:
    """Kill worker ``index`` and return once Ray says it is dead: ``ray.kill`` returns before the
    actor is gone, and a call sent meanwhile may still run on it."""
    actor = group.workers[index]
    ray.kill(actor, no_restart=True)
    until_dead([actor], SAFETY_S)
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(actor.where.remote(), timeout=SAFETY_S)


def _batch(n: int) -> tuple[BatchedDataDict, list]:
    from rollgen.sampling import SampleParams

    batch = BatchedDataDict(
        {"input_ids": torch.arange(n).unsqueeze(1), "input_lengths": torch.ones(n, dtype=torch.long)}
    )
    return batch, [SampleParams(1.0, 1.0, -1, 4, (), (), i) for i in range(n)]


def test_uneven_shards_merge_in_order_and_a_dead_replicas_shard_runs_again(probes) -> None:
    """``Replicas.shard``: uneven shards in order, empty ones not sent; with ``replaces``, the
    shard of a replica that died runs again on the survivor, which the table alone records as
    out of service."""
    from rollgen.distributed.replicas import Replicas

    replicas = Replicas(probes, "probes", replaces=True)
    out = replicas.shard(*_batch(5))
    assert [o.flatten().tolist() for o in out] == [[0, 1, 2], [3, 4]]
    assert len(replicas.shard(*_batch(1))) == 1, "empty shards are not sent"
    _killed(probes, 1)
    out = replicas.shard(*_batch(5))
    assert torch.cat(out).flatten().tolist() == [0, 1, 2, 3, 4]
    assert replicas.live == [0] and replicas.table[1].state == "dead"
    assert "rollgen-dp1" in (replicas.table[1].last_error or "")
    assert [o.flatten().tolist() for o in replicas.shard(*_batch(2))] == [[0, 1]], "on the survivor alone"


def test_without_replacement_a_death_in_a_shard_is_raised(probes) -> None:
    from rollgen.distributed.replicas import Replicas

    replicas = Replicas(probes, "probes", replaces=False)
    _killed(probes, 0)
    with pytest.raises(WorkerError, match="rollgen-dp0.*died") as info:
        replicas.shard(*_batch(4))
    assert info.value.died and replicas.table[0].state == "dead"


def test_the_first_failure_surfaces_while_other_workers_still_run(probes) -> None:
    """Worker 0 never answers; worker 1 fails: the failure comes back at once (waiting on the
    workers in order would end in worker 0's time-out instead)."""
    refs = [probes.workers[0].block.remote(), probes.workers[1].fail.remote()]
    with pytest.raises(WorkerError) as info:
        probes.get(refs, timeout_s=300)
    assert info.value.worker == "rollgen-dp1" and "ZeroDivisionError" in str(info.value)


def test_raising_and_dying_workers_surface_as_worker_error(probes) -> None:
    with pytest.raises(WorkerError) as info:
        probes.call_all(ProbeWorker.fail)
    assert info.value.worker in probes.names and "ZeroDivisionError" in info.value.remote_traceback
    with pytest.raises(InputError) as typed:
        probes.call_all(ProbeWorker.fail_typed)
    assert typed.value.samples == [3]
    ref = probes.workers[1].die.remote()
    with pytest.raises(WorkerError, match="rollgen-dp1.*died"):
        probes.get([ref], names=["rollgen-dp1"], timeout_s=60)
    with pytest.raises(WorkerError, match="died"):
        probes.call_all(ProbeWorker.where)


@pytest.fixture
def one_gpu_node():
    """A simulated node with one (logical) GPU."""
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "num_gpus": 1})
    ray.init(address=cluster.address, include_dashboard=False)
    yield
    ray.shutdown()
    cluster.shutdown()


def test_fractional_gpu_bundles_share_one_gpu(one_gpu_node) -> None:
    shared = [
        RayVirtualCluster([1], use_gpus=True, cpus_per_bundle=0.25, gpus_per_bundle=0.25) for _ in range(3)
    ]
    try:
        group = RayWorkerGroup(
            shared[0],
            RayWorkerBuilder(PROBE, lambda group, i: ("t", group, i)),
            tp_size=1,
            leader_resources={"num_cpus": 0.1, "num_gpus": 0.125},
        )
        assert group.dp_size == 1
        group.shutdown()
        with pytest.raises(ConfigError, match="could not reserve"):
            RayVirtualCluster([1], use_gpus=True, cpus_per_bundle=0.25, ready_timeout_s=3)
    finally:
        for vc in shared:
            vc.shutdown()
    with pytest.raises(ConfigError, match="gpus_per_bundle"):
        RayVirtualCluster([1], use_gpus=True, gpus_per_bundle=1.5)


def plan(use_gpus: bool, **engine: object):  # type: ignore[no-untyped-def]
    from rollgen.config import validate_config
    from rollgen.distributed.generation import plan_engines
    from rollgen_sglang.config import SglangConfig

    cfg = validate_config(
        {
            "backend": "sglang",
            "model_name": "m",
            "max_new_tokens": 4,
            "pad_token_id": 0,
            "seed": 5,
            "sglang_cfg": engine,
            "sglang_kwargs": {"x": 1},
        },
        SglangConfig,
    )
    return plan_engines(
        cfg, "sglang_cfg", use_gpus=use_gpus, engine_dtype="bfloat16", context_length=128, reserved_context=6
    )


def test_engine_plan_is_computed_without_ray() -> None:
    """What the driver starts, from a validated config alone: the worker spec (dtype, context,
    seed, the engine sub-dict with its defaults, the pass-through kwargs), sleep mode resolved
    for the machine, the bundles to reserve and the context prompts are checked against."""
    gpu = plan(True, data_parallel_size=2)
    assert gpu.spec.dtype == "bfloat16" and gpu.spec.context_length == 128 and gpu.max_model_len == 122
    assert gpu.spec.seed == 5 and gpu.spec.engine_kwargs == {"x": 1} and gpu.spec.pad_token_id == 0
    assert gpu.spec.sleep_enabled and gpu.spec.engine["mem_fraction_static"] == 0.5
    assert gpu.data_parallel_size == 2 and gpu.cpus_per_bundle == 1.0 and gpu.gpus_per_bundle == 1.0
    one = gpu.worker_spec(TiedGroup(0, (2, 3)), 1)
    assert (one.group, one.index, one.dtype) == (TiedGroup(0, (2, 3)), 1, "bfloat16")
    cpu = plan(False, cpus_per_bundle=0.25)
    assert not cpu.spec.sleep_enabled and cpu.cpus_per_bundle == 0.25 and not cpu.spec.use_gpus


def test_engine_plan_refuses_what_cannot_work_on_the_machine() -> None:
    with pytest.raises(ConfigError, match="enable_sleep_mode needs CUDA"):
        plan(False, enable_sleep_mode=True)
    with pytest.raises(ConfigError, match="whole GPU per rank"):
        plan(True, tensor_parallel_size=2, gpus_per_bundle=0.5)


def test_a_sample_goes_to_its_preferred_replica_while_it_has_room_else_the_least_loaded() -> None:
    from rollgen.distributed.dispatch import place

    assert place(1, [5, 2]) == 1, "the replica holding its prefix, while it has room"
    assert place(1, [5, 0]) == 0, "a full preferred replica: the one with the most room"
    assert place(None, [2, 5, 5]) == 1, "no preference: the most room, the first of equals"
    assert place(7, [0, 3]) == 1, "a replica the dispatcher does not have is no preference"
    assert place(0, [0, 0]) is None and place(None, [0, -1]) is None, "nothing has room: it waits"


class _Calls:
    """A stand-in for a Ray actor method (``.remote`` records its arguments), not an actor."""

    def __init__(self, log: list[tuple[str, int, Any]], name: str, engine: int) -> None:
        self.log, self.name, self.engine = log, name, engine

    def remote(self, *args: Any) -> object:
        self.log.append((self.name, self.engine, args))
        return object()


class _StandInGroup:
    """A stand-in worker group of two engines whose calls are only recorded (for the
    dispatcher's bookkeeping, without Ray); each started with room for one sample."""

    def __init__(self, capacity: int = 1) -> None:
        self.capacity = capacity
        #: As a real group's before its engines start: no limit.
        self.call_timeout_s: float | None = None
        self.log: list[tuple[str, int, Any]] = []
        self.names = ["engine 0", "engine 1"]
        self.workers = [
            type("W", (), {m: _Calls(self.log, m, i) for m in ("start_samples", "abort_samples", "poll")})()
            for i in range(2)
        ]

    def call_all(self, method: Any) -> list[dict[str, Any]]:
        assert method.__name__ == "ready"
        return [{"node": "here", "pid": 0, "devices": [], "capacity": self.capacity}] * 2


def test_a_streaming_sample_of_a_dead_engine_continues_from_the_tokens_it_streamed() -> None:
    """The dispatcher hands on a streaming sample's tokens as its engine makes them; when the
    engine dies, the sample restarts elsewhere from its prompt and those tokens (its budget
    less them), and its end is reported with them first: nothing handed on is taken back."""
    from rollgen.distributed.dispatch import SampleDispatcher
    from rollgen.distributed.replicas import Replicas
    from rollgen.rollout import FinishedSample, SampleProgress, SampleRequest
    from rollgen.sampling import SampleParams

    group = _StandInGroup()
    replicas = Replicas(group, "stand-in", replaces=True)  # type: ignore[arg-type]
    ended: list[FinishedSample] = []
    shown: list[SampleProgress] = []
    dispatcher = SampleDispatcher(replicas, ended.extend, lambda e: None, progress=shown.extend)
    params = SampleParams(1.0, 1.0, -1, 10, (), (2,), 7)
    streaming = SampleRequest("0:0:0", (5, 6), params, replica=0, stream_tokens=True)
    plain = SampleRequest("0:1:0", (5, 6), params, replica=0)
    with dispatcher._lock:  # as start() does, without its polling thread
        dispatcher._queue.extend([streaming, plain])
        dispatcher._send()
    assert [(e, [r.key for r in args[0]]) for name, e, args in group.log] == [(0, ["0:0:0"]), (1, ["0:1:0"])]
    dispatcher._moved(0, [SampleProgress("0:0:0", (30, 31), (-0.1, -0.2))])
    assert shown == [SampleProgress("0:0:0", (30, 31), (-0.1, -0.2))]
    replicas.take_out(0, "engine 0 died")  # its sample waits for engine 1's room
    dispatcher._ended(1, [FinishedSample("0:1:0", (40, 2), (-0.3, -0.4), replica=1)])
    (name, engine, (requests,)) = group.log[-1]
    (again,) = requests
    assert (name, engine) == ("start_samples", 1)
    assert again.prompt_ids == (5, 6, 30, 31) and again.params.max_new_tokens == 8
    dispatcher._ended(0, [FinishedSample("0:0:0", (30, 31, 2), (-0.1, -0.2, -0.3), replica=0)])
    assert [e.key for e in ended] == ["0:1:0"] and dispatcher._load == [0, 1], (
        "a late end reported by the engine it left is dropped: it runs on engine 1 now"
    )
    dispatcher._moved(0, [SampleProgress("0:0:0", (99,), (-9.0,))])  # a late report of the dead one
    dispatcher._moved(1, [SampleProgress("0:0:0", (32,), (-0.5,))])
    dispatcher._ended(1, [FinishedSample("0:0:0", (32, 33, 2), (-0.5, -0.6, -0.7), replica=1)])
    assert [s.token_ids for s in shown] == [(30, 31), (32,)]
    last = ended[-1]
    assert last.key == "0:0:0" and last.token_ids == (30, 31, 32, 33, 2) and last.restarts == 1
    assert last.logprobs == (-0.1, -0.2, -0.5, -0.6, -0.7)


def test_an_answer_that_cannot_be_read_fails_its_engines_samples_not_the_polling_thread() -> None:
    """A poll answered with something the dispatcher cannot read (a stand-in for a broken
    engine: the real one cannot be made to send it) ends that engine's samples with an error
    naming it and takes it out of service; the polling thread goes on (before, it died and
    every sample waited for ever)."""
    from rollgen.distributed.dispatch import SampleDispatcher
    from rollgen.distributed.replicas import Replicas
    from rollgen.rollout import FinishedSample, SampleRequest
    from rollgen.sampling import SampleParams

    group = _StandInGroup()
    group.get = lambda refs, names=None: [(None, [])]  # type: ignore[attr-defined]
    replicas = Replicas(group, "stand-in", replaces=True)  # type: ignore[arg-type]
    ended: list[FinishedSample] = []
    dispatcher = SampleDispatcher(replicas, ended.extend, lambda e: None)
    params = SampleParams(1.0, 1.0, -1, 10, (), (2,), 7)
    with dispatcher._lock:  # as start() does, without its polling thread
        dispatcher._queue.extend([SampleRequest("0:0:0", (5, 6), params, replica=0)])
        dispatcher._send()
        ref = object()
        dispatcher._polls[ref] = 0
    dispatcher._answer(ref)  # raised AttributeError before
    (failed,) = ended
    assert failed.key == "0:0:0" and failed.error and "engine 0" in failed.error
    assert "could not be read" in failed.error
    assert not replicas.in_service(0) and replicas.in_service(1)
    assert dispatcher._load == [0, 0]


def _unanswered(refs: list[Any], num_returns: int, timeout: float) -> tuple[list[Any], list[Any]]:
    """A stand-in for ``ray.wait``: the stand-in group's calls are never answered."""
    time.sleep(timeout)
    return [], refs


class _HeldCalls(_Calls):
    """A stand-in ``start_samples`` (not an actor) whose first call holds, as a slow call to an
    engine would, until ``release`` is set; each call's sample keys are kept in ``keys``."""

    def __init__(self, log: list[tuple[str, int, Any]], engine: int) -> None:
        super().__init__(log, "start_samples", engine)
        self.entered, self.release = threading.Event(), threading.Event()
        self.keys: list[list[str]] = []
        self.made = threading.Condition()

    def remote(self, *args: Any) -> object:
        if not self.keys:
            self.entered.set()
            self.release.wait(60)
        with self.made:
            self.keys.append([r.key for r in args[0]])
            self.made.notify_all()
        return super().remote(*args)


def test_samples_started_during_a_call_to_an_engine_go_to_it_together(monkeypatch) -> None:
    """``start`` only queues: while one call to an engine is being made, the samples started
    meanwhile wait (``start`` returns at once) and then go to it in one call, not one each."""
    from types import SimpleNamespace

    from rollgen.distributed import dispatch
    from rollgen.distributed.replicas import Replicas
    from rollgen.rollout import SampleRequest
    from rollgen.sampling import SampleParams

    monkeypatch.setattr(dispatch, "ray", SimpleNamespace(wait=_unanswered))
    group = _StandInGroup(capacity=8)
    held = group.workers[0].start_samples = _HeldCalls(group.log, 0)
    replicas = Replicas(group, "stand-in", replaces=True)  # type: ignore[arg-type]
    dispatcher = dispatch.SampleDispatcher(replicas, lambda ended: None, lambda e: None)
    params = SampleParams(1.0, 1.0, -1, 10, (), (2,), 7)
    try:
        dispatcher.start([SampleRequest("0:0:0", (5, 6), params, replica=0)])
        assert held.entered.wait(60), "the first sample's call was made"
        for i in range(1, 4):
            dispatcher.start([SampleRequest(f"{i}:0:0", (5, 6), params, replica=0)])
        assert held.keys == [], "the first call still holds: the others were only queued"
        held.release.set()
        with held.made:
            assert held.made.wait_for(lambda: len(held.keys) == 2, timeout=60)
        assert held.keys == [["0:0:0"], ["1:0:0", "2:0:0", "3:0:0"]]
        assert [r.running for r in dispatcher.load()] == [4, 0]
    finally:
        held.release.set()
        dispatcher.close()


def test_a_cancel_sends_the_samples_queued_with_it(monkeypatch) -> None:
    """A sample cancelled while ``start`` had only queued it is reported aborted, never started;
    the samples queued with it go to the engines then, without waiting for the sending thread
    (here one that never sends)."""
    from types import SimpleNamespace

    from rollgen.distributed import dispatch
    from rollgen.distributed.replicas import Replicas
    from rollgen.rollout import FinishedSample, SampleRequest
    from rollgen.sampling import SampleParams

    monkeypatch.setattr(dispatch, "ray", SimpleNamespace(wait=_unanswered))
    monkeypatch.setattr(dispatch.SampleDispatcher, "_sender", lambda self: None)
    group = _StandInGroup(capacity=8)
    ended: list[FinishedSample] = []
    replicas = Replicas(group, "stand-in", replaces=True)  # type: ignore[arg-type]
    dispatcher = dispatch.SampleDispatcher(replicas, ended.extend, lambda e: None)
    params = SampleParams(1.0, 1.0, -1, 10, (), (2,), 7)
    try:
        dispatcher.start([SampleRequest(f"0:{i}:0", (5, 6), params) for i in range(3)])
        dispatcher.abort(["0:1:0"])
        assert ended == [FinishedSample("0:1:0", (), (), aborted=True, started=False)]
        sent = [[r.key for r in args[0]] for name, _, args in group.log if name == "start_samples"]
        assert sorted(key for call in sent for key in call) == ["0:0:0", "0:2:0"]
    finally:
        dispatcher.close()


class _RefusedOnce(_Calls):
    """A stand-in ``start_samples`` (not an actor) whose first call Ray refuses at once (as it
    does a call it cannot pickle, or after it shut down)."""

    def __init__(self, log: list[tuple[str, int, Any]], engine: int) -> None:
        super().__init__(log, "start_samples", engine)
        self.refused = False

    def remote(self, *args: Any) -> object:
        if not self.refused:
            self.refused = True
            raise RuntimeError("Ray refused the call")
        return super().remote(*args)


def test_a_refused_call_fails_its_samples_and_frees_room_for_the_rest(monkeypatch) -> None:
    """When Ray refuses the call that starts samples on an engine, those samples end with the
    error (delivered by the sending thread), and the room they took goes to those waiting."""
    from types import SimpleNamespace

    from rollgen.distributed import dispatch
    from rollgen.distributed.replicas import Replicas
    from rollgen.rollout import FinishedSample, SampleRequest
    from rollgen.sampling import SampleParams

    monkeypatch.setattr(dispatch, "ray", SimpleNamespace(wait=_unanswered))
    group = _StandInGroup(capacity=2)
    group.workers[0].start_samples = _RefusedOnce(group.log, 0)
    ended: list[FinishedSample] = []
    delivered = threading.Condition()

    def deliver(samples: list[FinishedSample]) -> None:
        with delivered:
            ended.extend(samples)
            delivered.notify_all()

    replicas = Replicas(group, "stand-in", replaces=True)  # type: ignore[arg-type]
    dispatcher = dispatch.SampleDispatcher(replicas, deliver, lambda e: None)
    params = SampleParams(1.0, 1.0, -1, 10, (), (2,), 7)
    try:
        dispatcher.start([SampleRequest(f"{i}:0:0", (5, 6), params) for i in range(5)])
        with delivered:
            assert delivered.wait_for(lambda: len(ended) == 2, timeout=60)
        assert all(e.error and "samples could not be sent" in e.error and not e.started for e in ended)
        sent = [
            (engine, [r.key for r in args[0]]) for name, engine, args in group.log if name == "start_samples"
        ]
        assert sorted(key for _, keys in sent for key in keys) == sorted(
            {f"{i}:0:0" for i in range(5)} - {e.key for e in ended}
        ), "every sample not refused was sent, the last into the room the refused ones left"
        assert [r.running for r in dispatcher.load()] == [1, 2]
    finally:
        dispatcher.close()


def test_an_engine_is_judged_silent_only_for_the_time_the_dispatcher_listened() -> None:
    """An engine with samples and no token for ``call_timeout_s`` of the polling thread's
    listening is killed as wedged; a stall of the polling thread itself (its answers wait in
    Ray meanwhile) counts as at most ``POLL_S``, and a token heard resets the count."""
    from rollgen.distributed.dispatch import POLL_S, SampleDispatcher
    from rollgen.distributed.replicas import Replicas
    from rollgen.errors import WorkerError
    from rollgen.rollout import FinishedSample, SampleRequest
    from rollgen.sampling import SampleParams

    group = _StandInGroup()
    group.call_timeout_s = 10.0
    killed: list[set[str]] = []

    def kill_wedged(names: set[str], why: str) -> WorkerError:
        killed.append(names)
        return WorkerError(", ".join(names), why, died=True)

    group.kill_wedged = kill_wedged  # type: ignore[attr-defined]
    replicas = Replicas(group, "stand-in", replaces=True)  # type: ignore[arg-type]
    ended: list[FinishedSample] = []
    dispatcher = SampleDispatcher(replicas, ended.extend, lambda e: None)
    params = SampleParams(1.0, 1.0, -1, 10, (), (2,), 7)
    with dispatcher._lock:  # as start() does, without its polling thread
        dispatcher._queue.append(SampleRequest("0:0:0", (5, 6), params, replica=0))
        dispatcher._send()
    dispatcher._counted = 0.0
    dispatcher._kill_wedged(1000.0)  # the polling thread was away for 1000 s
    assert dispatcher._quiet[0] == POLL_S and not killed
    now = 1000.0
    for _ in range(int(9 / POLL_S)):
        now += POLL_S
        dispatcher._kill_wedged(now)
    dispatcher._heard(0, 3)  # a token: the count starts again
    assert dispatcher._quiet[0] == 0.0
    for _ in range(int(10 / POLL_S) + 1):
        now += POLL_S
        dispatcher._kill_wedged(now)
    assert killed == [{"engine 0"}]
    assert not replicas.in_service(0) and dispatcher._quiet == [0.0, 0.0]
