"""The contract's types: capabilities, config, input and output specs (spec version 1)."""

from __future__ import annotations

from enum import Enum
from typing import Annotated, Any, Literal

import torch
from pydantic import ConfigDict, Field
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

    def __str__(self) -> str:
        return self.value


_STRICT = ConfigDict(extra="forbid", strict=True)

NonNegFloat = Annotated[float, Field(ge=0.0)]
Probability = Annotated[float, Field(gt=0.0, le=1.0)]
PositiveInt = Annotated[int, Field(gt=0)]
TokenId = Annotated[int, Field(ge=0)]


class GenerationConfig(TypedDict):
    """Keys shared by every backend. Engine keys live in ``<engine>_cfg`` / ``<engine>_kwargs``."""

    __pydantic_config__ = _STRICT  # type: ignore[misc]

    backend: str
    model_name: str
    max_new_tokens: PositiveInt
    pad_token_id: TokenId
    temperature: NotRequired[NonNegFloat]
    top_p: NotRequired[Probability]
    top_k: NotRequired[Annotated[int, Field(ge=-1)] | None]
    stop_token_ids: NotRequired[list[TokenId] | None]
    stop_strings: NotRequired[list[str] | None]
    seed: NotRequired[int | None]
    logprobs_mode: NotRequired[Literal["raw", "processed"]]
    dtype: NotRequired[Literal["float32", "bfloat16", "float16", "auto"]]
    max_model_len: NotRequired[PositiveInt | None]


class RayEngineCfg(TypedDict):
    """Keys every Ray-actor backend's engine sub-dict shares (``vllm_cfg``, ``sglang_cfg``);
    defaults in ``rollgen.distributed.generation.RAY_ENGINE_DEFAULTS``."""

    __pydantic_config__ = _STRICT  # type: ignore[misc]

    tensor_parallel_size: NotRequired[PositiveInt]
    #: Engines to start when no cluster is given (with a cluster: its tied groups decide).
    data_parallel_size: NotRequired[PositiveInt]
    #: "auto": on where the engine supports it (CUDA), off on CPU.
    enable_sleep_mode: NotRequired[bool | Literal["auto"]]
    #: CPU bundles reserve this many Ray CPUs each (fractions leave room on small machines).
    cpus_per_bundle: NotRequired[Annotated[float, Field(gt=0)]]
    #: GPU share each bundle reserves: 1 (a whole GPU) or, for TP=1 only, a fraction so that several
    #: small engines (each with its own memory limit) share a GPU.
    gpus_per_bundle: NotRequired[Annotated[float, Field(gt=0, le=1)]]


#: Values used for the optional shared keys a config leaves out.
CONFIG_DEFAULTS: dict[str, Any] = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": None,
    "stop_token_ids": None,
    "stop_strings": None,
    "seed": None,
    "logprobs_mode": "raw",
    "dtype": "auto",
    "max_model_len": None,
}


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


class TextDatumSpec(TypedDict):
    prompts: list[str]
    stop_strings: NotRequired[list[list[str] | None]]


class TextOutputSpec(TypedDict):
    texts: list[str]


OUTPUT_KEYS = ("output_ids", "logprobs", "generation_lengths", "unpadded_sequence_lengths")
PER_SAMPLE_SAMPLING_KEYS = ("temperature", "top_p", "top_k", "max_new_tokens", "seed")
