"""Lifecycle: bad inputs are refused before any engine work (the engine stays usable); shutdown
is idempotent and final."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from rollgen.conformance.checks import assert_same_tokens, raises
from rollgen.errors import EngineClosed, InputError


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
