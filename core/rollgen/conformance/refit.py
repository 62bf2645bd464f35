"""Refit: outputs follow pushed weights exactly; bad updates are rejected before anything changes."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import pytest
import torch

import rollgen
from rollgen.conformance.checks import (
    assert_same_generation,
    assert_same_tokens,
    can_refit,
    check_against_reference,
    raises,
    skip_unless_declared,
)
from rollgen.errors import RefitError
from rollgen.spec import Capability


class RefitTests:
    """Refits of the shared engine, which ends each test on its original weights."""

    def test_refit_follows_new_weights(
        self,
        request: pytest.FixtureRequest,
        engine: Any,
        caps: frozenset[Capability],
        references: Callable[[str, str], Any],
        model_dir: str,
        other_model_dir: str,
        batch: dict[str, torch.Tensor],
        greedy_out: dict[str, torch.Tensor],
    ) -> None:
        new = references(other_model_dir, "float32")
        skip_unless_declared(can_refit(caps), "refit (refit_tensors or refit_ipc)", lambda: engine.refit(new))
        old = references(model_dir, "float32")
        # twice, in the same buckets: an engine that caches how it loads a layout reuses it
        for label in ("", "second_"):
            engine.refit(new, bucket_bytes=64 << 10, dtype=engine.engine_dtype)
            try:
                out = engine.generate(batch, greedy=True)
                assert not torch.equal(out["output_ids"], greedy_out["output_ids"]), (
                    f"{label}refit to other weights: greedy tokens unchanged {out['output_ids'].tolist()}"
                )
                stats = check_against_reference(new, out, batch, "float32")
                for k, v in stats.items():
                    request.node.user_properties.append((f"after_{label}refit_{k}", v))
            finally:
                buckets = rollgen.iter_buckets(
                    old, engine.local_transport, bucket_bytes=64 << 10, dtype=engine.engine_dtype
                )
                engine.update_weights(list(buckets))
            restored = engine.generate(batch, greedy=True)
            assert_same_generation(request, f"{label}restored", restored, greedy_out)

    def test_bad_refit_rejected(
        self,
        engine: Any,
        caps: frozenset[Capability],
        references: Callable[[str, str], Any],
        other_model_dir: str,
        batch: dict[str, torch.Tensor],
        greedy_out: dict[str, torch.Tensor],
    ) -> None:
        good = {
            k: v.to(engine.engine_dtype)
            for k, v in references(other_model_dir, "float32").state_dict().items()
        }
        skip_unless_declared(
            can_refit(caps), "refit (refit_tensors or refit_ipc)", lambda: engine.refit(good)
        )
        name = "model.norm.weight"
        bad_cases = {
            "unknown name": (
                "model.not_a_layer.weight",
                {**good, "model.not_a_layer.weight": torch.zeros(3)},
            ),
            "wrong shape": (
                name,
                {**good, name: torch.zeros(good[name].shape[0] + 1, dtype=engine.engine_dtype)},
            ),
            "wrong dtype": (name, {**good, name: good[name].to(torch.float16)}),
        }
        for label, (culprit, sd) in bad_cases.items():
            error = raises(RefitError, f"refit with a {label}", partial(engine.refit, sd))
            assert culprit in str(error), (
                f"refit with a {label}: the RefitError does not name {culprit!r}: {error}"
            )
        out = engine.generate(batch, greedy=True)
        assert_same_tokens(
            "after the rejected refits (the old weights serve)", out["output_ids"], greedy_out["output_ids"]
        )
