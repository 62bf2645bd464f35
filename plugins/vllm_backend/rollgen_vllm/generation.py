"""``VllmGeneration``: the trainer-facing side of the vLLM backend (docs/vllm.md)."""

from __future__ import annotations

from typing import Any, ClassVar

from rollgen.distributed import RayGeneration
from rollgen_vllm.config import VLLM_CFG_DEFAULTS


class VllmGeneration(RayGeneration):
    """vLLM engines in Ray actors. Logprobs are vLLM's raw logprobs."""

    worker_cls = "rollgen_vllm.worker:VllmWorker"
    engine_key = "vllm_cfg"
    engine_defaults: ClassVar[dict[str, Any]] = VLLM_CFG_DEFAULTS
