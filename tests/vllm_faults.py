"""Stand-ins for faults real vLLM cannot be made to produce on demand (real vLLM otherwise):
``FailOnceOnLastRank``, rollgen's worker extension whose load of a refit's second bucket fails
once, on the last rank of the weight-sync group (the second replica's, with DP=2); and
``WedgingWorker``, rollgen's vLLM worker whose ``generate`` hangs for ever once told to."""

import threading
from typing import Any

from rollgen.data import BatchedDataDict
from rollgen.distributed import GenerateRequest
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
