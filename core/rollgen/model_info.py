"""What rollgen reads from a local HF-format model folder without loading weights."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from rollgen.errors import ConfigError
from rollgen.refit import WeightSpec


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

    def context(self, max_model_len: int | None) -> int:
        """The context rollgen checks prompts against: ``max_model_len`` (a config's), else the
        model's. ConfigError if it is above the model's."""
        if (max_model_len or 0) > self.max_position_embeddings:
            raise ConfigError(
                f"max_model_len={max_model_len} is above the model's context of "
                f"{self.max_position_embeddings} tokens (max_position_embeddings in its config.json)"
            )
        return int(max_model_len or self.max_position_embeddings)

    def dtype(self, name: str) -> torch.dtype:
        """The torch dtype for a config ``dtype`` ("auto": the checkpoint's, else float32)."""
        if name == "auto":
            name = self.torch_dtype or "float32"
        dtype: torch.dtype = getattr(torch, name)
        return dtype

    def weight_spec(self, dtype: torch.dtype) -> WeightSpec:
        """Names and full shapes of the HF model's state dict (built on the meta device: no
        memory), with ``dtype``: what a refit of this model sends."""
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(self.path)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        return WeightSpec.of_module(model, dtype)

    @classmethod
    def from_dir(cls, path: str) -> ModelInfo:
        config_file = Path(path) / "config.json"
        if not config_file.is_file():
            raise ConfigError(
                f"model_name {path!r} is not a local model folder with a config.json "
                "(rollgen loads models from disk; `rollgen.testing.tiny_model_dir()` builds one)"
            )
        raw = _read_json(config_file)
        text = raw.get("text_config", raw)
        generation_file = Path(path) / "generation_config.json"
        generation = _read_json(generation_file) if generation_file.is_file() else {}
        eos = generation.get("eos_token_id", text.get("eos_token_id", raw.get("eos_token_id")))
        try:
            return cls(
                path=str(path),
                vocab_size=int(text["vocab_size"]),
                max_position_embeddings=int(text.get("max_position_embeddings", 2048)),
                torch_dtype=text.get("torch_dtype") or text.get("dtype"),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                eos_token_ids=_ids(eos),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(
                f"{config_file}: not a usable model config ({type(exc).__name__}: {exc})"
            ) from None

    def check_weight_files(self) -> None:
        """ConfigError unless the folder holds weights an engine can load: safetensors files whose
        headers read (the whole file is not read), or PyTorch ``.bin`` files."""
        folder = Path(self.path)
        tensors = sorted(folder.glob("*.safetensors"))
        for file in tensors:
            try:
                with safe_open(str(file), framework="pt") as f:
                    f.keys()
            except (SafetensorError, OSError) as exc:
                raise ConfigError(f"{file}: not a readable safetensors file ({exc})") from None
        if not tensors and not list(folder.glob("*.bin")):
            raise ConfigError(
                f"model folder {self.path!r} holds no weights (*.safetensors or *.bin); for random "
                "weights that a refit replaces, use the engine's load_format 'dummy' where it has one"
            )


def _read_json(file: Path) -> dict[str, Any]:
    try:
        data = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{file}: not readable JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{file}: expected a JSON object, got {type(data).__name__}")
    return data


def _ids(value: int | list[int] | None) -> tuple[int, ...]:
    """An HF config's token id field (one id, a list, or null) as a tuple."""
    if value is None:
        return ()
    return tuple(int(v) for v in (value if isinstance(value, list) else [value]))
