"""A stand-in for a fault real vLLM cannot be made to produce on demand: rollgen's worker
extension (real vLLM otherwise), whose load of a refit's second bucket fails once, on the last
rank of the weight-sync group (the second replica's, with DP=2)."""

from typing import Any

from rollgen_vllm.extension import RollgenWorkerExtension


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
