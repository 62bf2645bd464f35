"""The contract's types: capabilities, config, input and output specs (spec version 1)."""

from enum import Enum
from typing import Annotated, Any, Literal, TypeVar

import torch
from pydantic import AfterValidator, ConfigDict, Field
from typing_extensions import NotRequired, TypedDict

SPEC_VERSION = 1


class Capability(str, Enum):
    """What a backend can do. Calls that need an undeclared one raise UnsupportedCapability."""

    TEXT = "text"
    LOGPROBS = "logprobs"
    PROCESSED_LOGPROBS = "processed_logprobs"
    STOP_STRINGS = "stop_strings"
    PER_SAMPLE_SAMPLING = "per_sample_sampling"
    SLEEP_WAKE = "sleep_wake"
    REFIT_TENSORS = "refit_tensors"
    REFIT_IPC = "refit_ipc"
    REFIT_COLLECTIVE = "refit_collective"
    TENSOR_PARALLEL = "tensor_parallel"
    DATA_PARALLEL = "data_parallel"
    ASYNC = "async"
    #: LoRA adapters refitted alone, versioned (the config's ``lora``; ``refit(..., target="adapter")``).
    ADAPTERS = "adapters"

    def __str__(self) -> str:
        return self.value


#: Config types take no unknown key and coerce no value.
STRICT = ConfigDict(extra="forbid", strict=True)


def _not_zero(value: int) -> int:
    if value == 0:
        raise ValueError("top_k must be -1 (off) or at least 1")
    return value


#: The largest counts and ids an engine takes (engines hold them in 32-bit integers), and the
#: largest float32: every value below fits the tensors and engines it goes to.
INT32_MAX = 2**31 - 1
FLOAT32_MAX = 3.4028234663852886e38

#: The bounds of every sampling setting, shared by the config and the batch's per-sample values.
Temperature = Annotated[float, Field(ge=0.0, le=FLOAT32_MAX, allow_inf_nan=False)]
TopP = Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)]
#: -1 is off (the whole vocabulary), else at least 1.
TopK = Annotated[int, Field(ge=-1, le=INT32_MAX), AfterValidator(_not_zero)]
MaxNewTokens = Annotated[int, Field(gt=0, le=INT32_MAX)]
Seed = Annotated[int, Field(ge=0, lt=2**63)]
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]
PositiveInt = Annotated[int, Field(gt=0)]


#: The linear layers a LoRA setup adapts unless it names others (every projection of a Llama- or
#: Qwen-style decoder layer).
DEFAULT_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoraConfig(TypedDict):
    """The LoRA adapters a generation serves (``lora`` of the config; backends with the
    ``adapters`` capability). An adapter adds ``alpha / rank · B·A`` to each target linear layer's
    weight; PEFT's state-dict names (``rollgen.refit.adapters``)."""

    __pydantic_config__ = STRICT  # type: ignore[misc]

    rank: Annotated[int, Field(gt=0, le=1024)]
    #: None: ``rank`` (a scaling of 1).
    alpha: NotRequired[Annotated[float | None, Field(default=None, gt=0.0, allow_inf_nan=False)]]
    #: The layers' names (the last part of a module's name: ``q_proj``).
    target_modules: NotRequired[
        Annotated[list[str], Field(default_factory=lambda: list(DEFAULT_LORA_TARGETS), min_length=1)]
    ]
    #: How many adapter versions an engine holds at once: the current one, and older ones that
    #: samples in flight (a ``keep`` update) still decode with. An adapter refit that would need
    #: one more while every older version is in use is refused.
    max_versions: NotRequired[Annotated[int, Field(default=3, ge=2, le=64)]]


class GenerationConfig(TypedDict):
    """Keys shared by every backend, with their bounds and defaults. Engine keys live in
    ``<engine>_cfg`` / ``<engine>_kwargs``."""

    __pydantic_config__ = STRICT  # type: ignore[misc]

    backend: str
    model_name: str
    max_new_tokens: MaxNewTokens
    pad_token_id: TokenId
    temperature: NotRequired[Annotated[Temperature, Field(default=1.0)]]
    top_p: NotRequired[Annotated[TopP, Field(default=1.0)]]
    top_k: NotRequired[Annotated[TopK | None, Field(default=None)]]
    stop_token_ids: NotRequired[Annotated[list[TokenId] | None, Field(default=None)]]
    stop_strings: NotRequired[Annotated[list[str] | None, Field(default=None)]]
    seed: NotRequired[Annotated[Seed | None, Field(default=None)]]
    logprobs_mode: NotRequired[Annotated[Literal["raw", "processed"], Field(default="raw")]]
    dtype: NotRequired[Annotated[Literal["float32", "bfloat16", "float16", "auto"], Field(default="auto")]]
    max_model_len: NotRequired[Annotated[PositiveInt | None, Field(default=None)]]
    #: LoRA adapters (backends with the ``adapters`` capability); None: the model alone.
    lora: NotRequired[Annotated[LoraConfig | None, Field(default=None)]]


_Sub = TypeVar("_Sub")
#: A backend config's engine sub-dict (``vllm_cfg: NotRequired[EngineSubDict[VllmCfg]]``): left
#: out, it is ``{}`` with every default of its keys filled in.
EngineSubDict = Annotated[_Sub, Field(default_factory=dict, validate_default=True)]


class GenerationDatumSpec(TypedDict):
    """One input batch. ``input_ids`` is right-padded with ``pad_token_id``.

    The optional per-sample keys override the config for that sample: ``stop_strings`` (a list or
    None per sample), ``temperature``/``top_p``/``top_k``/``max_new_tokens`` (one value per sample)
    and ``seed`` (one int per sample: that sample's sampling is reproducible on its own).
    """

    input_ids: torch.Tensor
    input_lengths: torch.Tensor
    stop_strings: NotRequired[list[list[str] | None]]
    temperature: NotRequired[torch.Tensor]
    top_p: NotRequired[torch.Tensor]
    top_k: NotRequired[torch.Tensor]
    max_new_tokens: NotRequired[torch.Tensor]
    seed: NotRequired[torch.Tensor]


class GenerationOutputSpec(TypedDict):
    """What ``generate`` returns, identically for every backend (see docs/contract.md)."""

    output_ids: torch.Tensor
    logprobs: torch.Tensor
    generation_lengths: torch.Tensor
    unpadded_sequence_lengths: torch.Tensor
    #: Why each sample ended: ``"eos"``, ``"stop_token"``, ``"stop_string"``, ``"length"`` or
    #: ``"context"`` (``rollgen.output.STOP_REASONS``).
    stop_reasons: list[str]


#: Batch keys that override a config setting for each sample (tensors of shape [B]), with the
#: bounds of that setting.
PER_SAMPLE_SAMPLING_KEYS: dict[str, Any] = {
    "temperature": Temperature,
    "top_p": TopP,
    "top_k": TopK,
    "max_new_tokens": MaxNewTokens,
    "seed": Seed,
}
