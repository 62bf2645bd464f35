"""Testing helpers shipped with the core: a deterministic tiny model, its config and an HF
reference."""

from rollgen.testing.config import tiny_config
from rollgen.testing.reference import (
    agreement,
    load_reference_model,
    teacher_forced_logprobs,
    versioned_logprob_error,
)
from rollgen.testing.tiny_model import TinyModelRecipe, tiny_model_dir, with_generation_config

__all__ = [
    "TinyModelRecipe",
    "agreement",
    "load_reference_model",
    "teacher_forced_logprobs",
    "tiny_config",
    "tiny_model_dir",
    "versioned_logprob_error",
    "with_generation_config",
]
