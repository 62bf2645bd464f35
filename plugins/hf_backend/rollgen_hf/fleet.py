"""``HfRayGeneration``: the ``hf-ray`` backend, transformers engines as Ray actors (one per
data-parallel replica): the core's fleet (sharding, streamed samples, refit over the engines'
links, replacement of dead replicas) over the ``hf`` backend's decoding."""

from __future__ import annotations

from rollgen.distributed import RayGeneration
from rollgen.distributed.generation import EnginePlan
from rollgen.errors import ConfigError


class HfRayGeneration(RayGeneration):
    """One transformers model per Ray actor; no tensor parallelism."""

    worker_cls = "rollgen_hf.worker:HfWorker"
    engine_key = "hf_cfg"

    def make_plan(self, use_gpus: bool) -> EnginePlan:
        plan = super().make_plan(use_gpus)
        if plan.spec.tensor_parallel_size != 1:
            raise ConfigError(
                f"hf_cfg.tensor_parallel_size={plan.spec.tensor_parallel_size}: the hf-ray backend runs "
                "one model per engine; scale out with data_parallel_size, or use vllm or sglang for TP"
            )
        return plan
