"""What rollgen reads from a local HF-format model folder without loading weights."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from rollgen.errors import ConfigError
from rollgen.refit import WeightSpec, dtype_name


@dataclass(frozen=True)
class ModelInfo:
    path: str
    vocab_size: int
    max_position_embeddings: int
    torch_dtype: str | None
    tie_word_embeddings: bool
    #: The ids that end a sample: ``generation_config.json``'s ``eos_token_id`` (what HF's
    #: ``generate`` stops at), else ``config.json``'s.
    eos_token_ids: tuple[int, ...] = ()

    def weight_spec(self, dtype: torch.dtype) -> WeightSpec:
        """Names and full shapes of the HF model's state dict (built on the meta device: no
        memory), with ``dtype``: what a refit of this model sends."""
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(self.path)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        return {n: (tuple(t.shape), dtype_name(dtype)) for n, t in model.state_dict().items()}

    @classmethod
    def from_dir(cls, path: str) -> ModelInfo:
        config_file = Path(path) / "config.json"
        if not config_file.is_file():
            raise ConfigError(
                f"model_name {path!r} is not a local model folder with a config.json "
                "(rollgen loads models from disk; `rollgen.testing.tiny_model_dir()` builds one)"
            )
        raw = json.loads(config_file.read_text())
        text = raw.get("text_config", raw)
        generation_file = Path(path) / "generation_config.json"
        generation = json.loads(generation_file.read_text()) if generation_file.is_file() else {}
        eos = generation.get("eos_token_id", text.get("eos_token_id", raw.get("eos_token_id")))
        return cls(
            path=str(path),
            vocab_size=int(text["vocab_size"]),
            max_position_embeddings=int(text.get("max_position_embeddings", 2048)),
            torch_dtype=text.get("torch_dtype") or text.get("dtype"),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            eos_token_ids=_ids(eos),
        )


def _ids(value: int | list[int] | None) -> tuple[int, ...]:
    """An HF config's token id field (one id, a list, or null) as a tuple."""
    if value is None:
        return ()
    return tuple(int(v) for v in (value if isinstance(value, list) else [value]))
