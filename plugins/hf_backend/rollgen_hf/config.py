"""Config type of the ``hf`` backend (light: no transformers import)."""

from __future__ import annotations

from typing import Any, Literal

from typing_extensions import NotRequired, TypedDict

from rollgen.spec import GenerationConfig


class HfCfg(TypedDict):
    __pydantic_config__ = {"extra": "forbid", "strict": True}  # type: ignore[misc]

    #: "cpu", "cuda", "cuda:1", or "auto" (cuda when available).
    device: NotRequired[str]
    attn_implementation: NotRequired[Literal["eager", "sdpa"]]


class HfConfig(GenerationConfig):
    hf_cfg: NotRequired[HfCfg]
    #: Passed to ``AutoModelForCausalLM.from_pretrained`` as is.
    hf_kwargs: NotRequired[dict[str, Any]]
