"""Stand-ins for faults real vLLM cannot be made to produce on demand (real vLLM otherwise):
``FailOnceOnLastRank``, rollgen's worker extension whose load of a refit's second bucket fails
once, on the last rank of the weight-sync group (the second replica's, with DP=2);
``WedgingWorker``, rollgen's vLLM worker whose ``generate`` hangs for ever once told to;
``UnwatchedWorker``, rollgen's vLLM worker whose watcher of the engine's processes looks once
an hour; ``StepRecorder`` (a probe, not a fault), rollgen's worker extension that records
whether each step holds the refit channel's lock; ``LoadWays`` (a probe), one that records how
each refit bucket was loaded; and
``DyingRank``, rollgen's worker extension that kills its engine's actor at a chosen point inside
a call (``arm_death``): the real death of a replica, at a moment a kill from outside cannot
pick."""

import itertools
import logging
import logging.handlers
import threading
from typing import Any

import ray

from rollgen.data import BatchedDataDict
from rollgen.distributed import GenerateRequest
from rollgen.testing.faults import kill_process
from rollgen_vllm.extension import RollgenWorkerExtension
from rollgen_vllm.generation import VllmGeneration
from rollgen_vllm.worker import VllmWorker


class FailOnceOnLastRank(RollgenWorkerExtension):
    def rollgen_load(self, named: Any, replay: bool, kept: bool = False) -> Any:
        sync = getattr(self, "rollgen_sync", None)
        if (
            sync is not None
            and sync.rank == sync.spec.world_size - 1
            and not getattr(self, "fault_fired", False)
        ):
            self.fault_loads = getattr(self, "fault_loads", 0) + 1
            if self.fault_loads == 2:
                self.fault_fired = True
                raise RuntimeError("injected fault: this rank's second bucket fails to load")
        return super().rollgen_load(named, replay, kept)


class WedgingWorker(VllmWorker):
    wedged = False

    def wedge(self) -> None:
        """From now on, ``generate`` never returns (as an engine stuck in a step)."""
        self.wedged = True

    def generate(self, request: GenerateRequest) -> BatchedDataDict[Any]:
        if self.wedged:
            threading.Event().wait()
        return super().generate(request)


class WedgingGeneration(VllmGeneration):
    """The vLLM backend on ``WedgingWorker``s."""

    worker_cls = "tests.vllm_faults:WedgingWorker"


def engine_core(actor_pid: int) -> int:
    """The pid of the engine core of the vLLM worker whose actor is ``actor_pid``: the actor's
    child among the engine's processes (titled ``VLLM::EngineCore``, or not titled)."""
    import psutil

    from rollgen.processes import descendants, engine_processes

    children = {p.pid for p in psutil.Process(actor_pid).children()}
    core = [p for p in engine_processes(actor_pid, VllmWorker.engine_processes) if p in children]
    assert len(core) == 1, descendants(actor_pid)
    return core[0]


class UnwatchedWorker(VllmWorker):
    """rollgen's vLLM worker whose watcher looks at the engine's processes once an hour: the
    moment between an engine process's end and the watcher's next look, held open."""

    watch_interval_s = 3600.0

    def engine_seen_dead(self) -> bool:
        """Whether vLLM's client has seen its engine core end (its own flag): a call then
        raises ``EngineDeadError`` (one sent before that waits for an answer that never comes)."""
        return bool(self.llm.llm_engine.engine_core.resources.engine_dead)


class UnwatchedGeneration(VllmGeneration):
    """The vLLM backend on ``UnwatchedWorker``s."""

    worker_cls = "tests.vllm_faults:UnwatchedWorker"


class StepRecorder(RollgenWorkerExtension):
    """rollgen's worker extension that records, at each model-runner step, whether the step holds
    the lock of the rank's refit channel (a probe, not a fault: real vLLM otherwise)."""

    @property
    def rollgen_steps(self) -> threading.Lock:
        if getattr(self, "_rollgen_steps", None) is None:  # under the lock rollgen wraps it in
            runner, self.steps_locked = self.model_runner, []
            step = runner.execute_model

            def recorded(*args: Any, **kwargs: Any) -> Any:
                self.steps_locked.append(self._rollgen_steps.locked())
                return step(*args, **kwargs)

            runner.execute_model = recorded
        return super().rollgen_steps

    def recorded_steps(self) -> list[bool]:
        """Whether each step so far held the lock."""
        return list(getattr(self, "steps_locked", []))


class LoadWays(RollgenWorkerExtension):
    """rollgen's worker extension that records how each bucket was loaded (``LoadWay``), and what
    the load plans logged (why a layout got no plan: a probe, not a fault: real vLLM otherwise)."""

    def rollgen_load(self, named: Any, replay: bool, kept: bool = False) -> Any:
        if not hasattr(self, "probe_ways"):
            self.probe_ways: list[str] = []
            self.probe_logs = logging.handlers.BufferingHandler(1000)
            plans = logging.getLogger("rollgen_vllm.load_plan")
            plans.addHandler(self.probe_logs)
            plans.setLevel(logging.INFO)
        way = super().rollgen_load(named, replay, kept)
        self.probe_ways.append(way)
        return way

    def recorded_ways(self) -> list[str]:
        """Each load's way, then what the plans logged."""
        logs = [r.getMessage() for r in self.probe_logs.buffer] if hasattr(self, "probe_logs") else []
        return [*getattr(self, "probe_ways", []), *logs]


class DyingRank(RollgenWorkerExtension):
    """Once armed (``arm_death``), kills its engine's actor (SIGKILL, then waits until it is
    gone) at its ``steps``-th engine step or as it loads its ``buckets``-th refit bucket, and
    goes on as the engine's processes do after such a death (until Ray ends them)."""

    def fault_arm_death(self, actor: int, steps: int, buckets: int) -> None:
        self.fault_actor, self.fault_buckets = actor, buckets
        if steps:
            step, count = self.execute_model, itertools.count(1)

            def execute_model(*args: Any, **kwargs: Any) -> Any:
                if next(count) == steps:
                    kill_process(actor)
                return step(*args, **kwargs)

            self.execute_model = execute_model

    def rollgen_load(self, named: Any, replay: bool, kept: bool = False) -> Any:
        if getattr(self, "fault_buckets", 0):
            self.fault_buckets -= 1
            if not self.fault_buckets:
                kill_process(self.fault_actor)
        return super().rollgen_load(named, replay, kept)


def arm_death(gen: Any, index: int, *, steps: int = 0, buckets: int = 0) -> None:
    """Have replica ``index`` of ``gen`` (started with ``DyingRank`` as its
    ``worker_extension_cls``) die at its ``steps``-th engine step, or at its ``buckets``-th
    refit bucket, from now on."""
    worker, pid = gen.engines.group.workers[index], gen.engines.info(index)["pid"]
    ray.get(worker.collective_rpc.remote("fault_arm_death", (pid, steps, buckets), {}))


def fleet_config(hf_config: dict, in_process: bool, **top: object) -> dict:
    """A vLLM-CPU DP=2 fleet with ``engine_failures: "replace"`` over the test model, its ranks
    ``DyingRank``s (``arm_death``); ``in_process``: the engine core in the actor's process."""
    cfg = {**hf_config, "backend": "vllm", "max_new_tokens": 12, **top}
    cfg["vllm_cfg"] = {
        "kv_cache_memory_bytes": 64 << 20,
        "in_process": in_process,
        "cpus_per_bundle": 0.1,
        "data_parallel_size": 2,
        "engine_failures": "replace",
        "max_restarts": 20,
    }
    cfg["vllm_kwargs"] = {"worker_extension_cls": "tests.vllm_faults.DyingRank"}
    return cfg
