"""Config type of the ``vllm`` backend (light: no vllm import)."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field
from typing_extensions import NotRequired

from rollgen.spec import GenerationConfig, RayEngineCfg


class VllmCfg(RayEngineCfg):
    gpu_memory_utilization: NotRequired[Annotated[float, Field(gt=0, le=1)]]
    #: KV cache size in bytes (CPU needs one: vLLM-CPU otherwise reserves ~17 GiB).
    kv_cache_memory_bytes: NotRequired[Annotated[int, Field(gt=0)] | None]
    enforce_eager: NotRequired[bool]
    load_format: NotRequired[str]
    #: Run the engine core inside the actor process (VLLM_ENABLE_V1_MULTIPROCESSING=0).
    in_process: NotRequired[bool]
    #: On GPU, load a refit of a layout seen before by replaying the copies vLLM's weight loaders
    #: made the first time, once verified (``rollgen.load_plan``); false: the loaders every time.
    replay_refit: NotRequired[bool]


#: Defaults of the vLLM-only keys (the Ray keys' defaults are rollgen.distributed's).
VLLM_CFG_DEFAULTS: dict[str, Any] = {
    "gpu_memory_utilization": 0.5,
    "kv_cache_memory_bytes": None,
    "enforce_eager": True,
    "load_format": "auto",
    "in_process": False,
    "replay_refit": True,
}


class VllmConfig(GenerationConfig):
    vllm_cfg: NotRequired[VllmCfg]
    #: Passed to ``vllm.LLM`` as is.
    vllm_kwargs: NotRequired[dict[str, Any]]
