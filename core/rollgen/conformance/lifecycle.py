"""Lifecycle: bad inputs are refused before any engine work (the engine stays usable); shutdown
is idempotent and final."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch

import rollgen
from rollgen.config import deep_merge
from rollgen.conformance.checks import assert_same_tokens, raises
from rollgen.errors import ConfigError, EngineClosed, InputError


class BadInputTests:
    """Bad inputs to the shared engine."""

    def test_bad_inputs_raise_and_engine_survives(
        self,
        engine: Any,
        batch: dict[str, torch.Tensor],
        greedy_out: dict[str, torch.Tensor],
        base_config: dict[str, Any],
    ) -> None:
        pad = base_config["pad_token_id"]
        ids, lengths = batch["input_ids"], batch["input_lengths"]
        left = ids.clone()
        n = int(lengths[1])
        left[1] = pad
        left[1, ids.shape[1] - n :] = ids[1, :n]
        cases: dict[str, tuple[dict[str, Any], list[int] | None]] = {
            "left padded": ({"input_ids": left, "input_lengths": lengths}, [1]),
            "length too large": (
                {"input_ids": ids, "input_lengths": lengths.clone().index_fill_(0, torch.tensor([2]), 99)},
                [2],
            ),
            "zero length": (
                {"input_ids": ids, "input_lengths": lengths.clone().index_fill_(0, torch.tensor([3]), 0)},
                [3],
            ),
            "wrong dtype": ({"input_ids": ids.int(), "input_lengths": lengths}, None),
            "wrong shape": ({"input_ids": ids[0], "input_lengths": lengths}, None),
            "too long for context": (
                {
                    "input_ids": torch.ones((1, engine.max_model_len + 1), dtype=torch.long),
                    "input_lengths": torch.tensor([engine.max_model_len + 1]),
                },
                [0],
            ),
            "bad stop_strings": ({**batch, "stop_strings": [None, "x", None, None, None]}, [1]),
        }
        two = {"input_ids": ids[:2], "input_lengths": lengths[:2]}
        per_sample: dict[str, tuple[dict[str, Any], list[int] | None]] = {
            "NaN temperature": ({**two, "temperature": torch.tensor([1.0, float("nan")])}, [1]),
            "NaN top_p": ({**two, "top_p": torch.tensor([float("nan"), 0.5])}, [0]),
            "fractional max_new_tokens": ({**two, "max_new_tokens": torch.tensor([2.7, 3.0])}, None),
            "fractional seed": ({**two, "seed": torch.tensor([1.5, 2.0])}, None),
            "top_k 0": ({**two, "top_k": torch.tensor([0, 5])}, [0]),
            "strings as temperatures": ({**two, "temperature": ["hot", "cold"]}, None),
            "misspelt key": ({**two, "temprature": torch.tensor([1.0, 1.0])}, None),
        }
        for key, (low, high) in getattr(engine, "sampling_limits", {}).items():
            if high is not None:
                per_sample[f"{key} above the engine's {high}"] = (
                    {**two, key: torch.tensor([high, high + 1])},
                    [1],
                )
            if low is not None:
                per_sample[f"{key} below the engine's {low}"] = (
                    {**two, key: torch.tensor([low, low - 1])},
                    [1],
                )
        cases.update(per_sample)
        for label, (data, samples) in cases.items():
            error = raises(InputError, f"input {label}", partial(engine.generate, data, greedy=True))
            if samples is not None:
                assert error.samples == samples, (
                    f"input {label}: the InputError names samples {error.samples}, expected {samples}"
                )
        out = engine.generate(batch, greedy=True)
        assert_same_tokens(
            "after the refused inputs (the engine stays usable)", out["output_ids"], greedy_out["output_ids"]
        )


class LifecycleTests:
    """Shutdown, on an engine of its own (the suite's last test)."""

    def test_shutdown_idempotent(
        self, make_engine: Callable[..., Any], batch: dict[str, torch.Tensor]
    ) -> None:
        with make_engine() as engine:
            engine.generate(batch, greedy=True)
        engine.shutdown()
        raises(EngineClosed, "generate after shutdown", lambda: engine.generate(batch, greedy=True))

    def test_broken_model_folders_are_config_errors(
        self, base_config: dict[str, Any], model_dir: str, tmp_path_factory: pytest.TempPathFactory
    ) -> None:
        """A model folder whose config.json is not JSON, or whose weights are missing or not
        safetensors: a ConfigError naming the file, before any engine starts."""
        cases = {
            "config.json": ("config.json", "{ not json"),
            "missing weights": ("model.safetensors", None),
            "garbage weights": ("model.safetensors", "garbage, not a safetensors header"),
        }
        for label, (name, content) in cases.items():
            folder = tmp_path_factory.mktemp("broken-model")
            for f in Path(model_dir).iterdir():
                if f.name != name:
                    (folder / f.name).symlink_to(f.resolve())
            if content is not None:
                (folder / name).write_text(content)
            config = deep_merge(base_config, {"model_name": str(folder)})
            error = raises(
                ConfigError, f"a model folder with {label}", partial(rollgen.create_generation, config)
            )
            assert name in str(error) or "no weights" in str(error), (
                f"a model folder with {label}: the ConfigError does not name {name}: {error}"
            )
