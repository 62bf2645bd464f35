"""Config types of the ``hf`` and ``hf-ray`` backends (light: no transformers or Ray import)."""

from typing import Annotated, Any, Literal

from pydantic import Field
from typing_extensions import NotRequired, TypedDict

from rollgen.distributed.config import RayEngineCfg
from rollgen.spec import STRICT, EngineSubDict, GenerationConfig

#: transformers' attention kernel (None: the model's default); a key of both backends' ``hf_cfg``.
AttnImplementation = NotRequired[Annotated[Literal["eager", "sdpa"] | None, Field(default=None)]]
#: Passed to ``AutoModelForCausalLM.from_pretrained`` as is (``hf_kwargs`` of both backends).
HfKwargs = NotRequired[Annotated[dict[str, Any], Field(default_factory=dict)]]


class HfCfg(TypedDict):
    __pydantic_config__ = STRICT  # type: ignore[misc]

    #: "cpu", "cuda", "cuda:1", or "auto" (cuda when available).
    device: NotRequired[Annotated[str, Field(default="auto")]]
    attn_implementation: AttnImplementation


class HfConfig(GenerationConfig):
    hf_cfg: NotRequired[EngineSubDict[HfCfg]]
    hf_kwargs: HfKwargs


class HfRayCfg(RayEngineCfg):
    """``hf_cfg`` of the ``hf-ray`` backend: the Ray engines' keys (the device is the one Ray
    gives each engine; ``tensor_parallel_size`` stays 1)."""

    attn_implementation: AttnImplementation


class HfRayConfig(GenerationConfig):
    hf_cfg: NotRequired[EngineSubDict[HfRayCfg]]
    hf_kwargs: HfKwargs
