"""The transformers model both ``hf`` backends serve: loading it, and moving it off and back
onto its GPU for sleep and wake."""

from __future__ import annotations

import gc
from collections.abc import Mapping
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from rollgen.errors import ConfigError


def load_model(
    model_name: str,
    dtype: torch.dtype,
    device: torch.device,
    attn_implementation: str | None,
    kwargs: Mapping[str, Any],
) -> Any:
    """The causal LM of ``model_name`` in ``dtype`` on ``device``, in eval mode (``kwargs``:
    ``hf_kwargs``, passed to ``from_pretrained`` as is). ConfigError for keywords it rejects."""
    kwargs = dict(kwargs)
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    try:
        model = AutoModelForCausalLM.from_pretrained(model_name, dtype=dtype, **kwargs)
    except TypeError as exc:  # a keyword the model's constructor does not take
        raise ConfigError(f"hf_kwargs {sorted(kwargs)} were not accepted: {exc}") from None
    return model.to(device).eval()


def offload(model: Any) -> None:
    """Sleep: move ``model`` to host memory and free what it held on its GPU."""
    model.to("cpu")
    gc.collect()
    torch.cuda.empty_cache()


def release_memory(device: torch.device) -> None:
    """Give back the memory of a model just dropped (its last reference deleted) from ``device``."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
