"""The generation config of the tiny model, as the CLI and the conformance suite build it."""

from __future__ import annotations

from typing import Any

from rollgen.config import deep_merge
from rollgen.testing.tiny_model import tiny_model_dir


def tiny_config(backend: str, model_dir: str | None = None, **overrides: Any) -> dict[str, Any]:
    """A config for ``backend`` on the tiny model (or the local model in ``model_dir``): the pad
    id of its tokenizer (its EOS id where it has none), 12 new tokens, seed 0, then
    ``overrides`` merged in deeply (an engine sub-dict adds keys)."""
    from transformers import AutoTokenizer

    model_dir = model_dir or tiny_model_dir()
    tok = AutoTokenizer.from_pretrained(model_dir)
    cfg: dict[str, Any] = {
        "backend": backend,
        "model_name": model_dir,
        "max_new_tokens": 12,
        "pad_token_id": tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id,
        "seed": 0,
    }
    return deep_merge(cfg, overrides)
