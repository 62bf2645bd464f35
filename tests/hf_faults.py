"""Stand-ins for faults a real hf engine cannot be made to produce on demand (real hf
otherwise): ``StuckWorker``, rollgen's hf worker whose engine, as replica 0, never comes back
from a decoding step (an engine stuck in a step: a hung kernel or collective)."""

import threading

from rollgen.streaming_loop import StepOutput
from rollgen_hf.fleet import HfRayGeneration
from rollgen_hf.worker import HfWorker


class StuckWorker(HfWorker):
    def _step(self) -> list[StepOutput]:
        if self.spec.index == 0:
            threading.Event().wait()
        return super()._step()


class StuckGeneration(HfRayGeneration):
    """The hf-ray backend on ``StuckWorker``s."""

    worker_cls = "tests.hf_faults:StuckWorker"
