"""Config type of the ``vllm`` backend (light: no vllm import)."""

from typing import Annotated, Any, Literal

from pydantic import Field
from typing_extensions import NotRequired

from rollgen.distributed.config import RayEngineCfg
from rollgen.spec import EngineSubDict, GenerationConfig, PositiveInt


class VllmCfg(RayEngineCfg):
    gpu_memory_utilization: NotRequired[Annotated[float, Field(gt=0, le=1, default=0.5)]]
    #: KV cache size in bytes. None: vLLM's own sizing on GPU (``gpu_memory_utilization``); on CPU,
    #: where vLLM would reserve ~17 GiB, an eighth of the machine's memory shared by the engines,
    #: 256 MiB to 4 GiB each.
    kv_cache_memory_bytes: NotRequired[Annotated[PositiveInt | None, Field(default=None)]]
    enforce_eager: NotRequired[Annotated[bool, Field(default=True)]]
    load_format: NotRequired[Annotated[str, Field(default="auto")]]
    #: Run the engine core inside the actor process (VLLM_ENABLE_V1_MULTIPROCESSING=0). "auto": on
    #: CPU (an engine starts in 2 s instead of 15 s), not on GPU.
    in_process: NotRequired[Annotated[bool | Literal["auto"], Field(default="auto")]]
    #: On GPU, load a refit of a layout seen before by replaying the copies vLLM's weight loaders
    #: made the first time, once verified (``rollgen_vllm.load_plan``); false: the loaders every time.
    replay_refit: NotRequired[Annotated[bool, Field(default=True)]]
    #: On GPU, a colocated trainer's refit of the very tensors it refitted last has the engines
    #: read them in place (``rollgen.refit.in_place``: no staging buffer, one copy) instead of through
    #: the staging buffers; it keeps the source's storages allocated until released (docs/vllm.md).
    refit_in_place: NotRequired[Annotated[bool, Field(default=True)]]


class VllmConfig(GenerationConfig):
    vllm_cfg: NotRequired[EngineSubDict[VllmCfg]]
    #: Passed to ``vllm.LLM`` as is.
    vllm_kwargs: NotRequired[Annotated[dict[str, Any], Field(default_factory=dict)]]
