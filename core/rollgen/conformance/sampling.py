"""Sampling: determinism, per-sample settings, stop strings and ids, EOS, seeds, processed
logprobs and agreement with the HF reference."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from rollgen.conformance.checks import (
    assert_same_generation,
    assert_same_tokens,
    check_against_reference,
    fp32_bound,
    skip_unless_declared,
)
from rollgen.output import generated_mask
from rollgen.spec import Capability
from rollgen.testing.prompts import generated_texts
from rollgen.testing.reference import agreement, teacher_forced_logprobs
from rollgen.testing.tiny_model import with_generation_config


class SamplingTests:
    """Sampling on the shared engine."""

    def test_greedy_determinism(
        self,
        request: pytest.FixtureRequest,
        engine: Any,
        batch: dict[str, torch.Tensor],
        greedy_out: dict[str, torch.Tensor],
    ) -> None:
        again = engine.generate(batch, greedy=True)
        assert_same_generation(request, "repeat", again, greedy_out)

    def test_per_sample_sampling(
        self,
        engine: Any,
        caps: frozenset[Capability],
        greedy_out: dict[str, torch.Tensor],
        batch: dict[str, torch.Tensor],
    ) -> None:
        data = dict(batch)
        data["temperature"] = torch.tensor([0.0, 1.0, 0.0, 1.0, 0.0])
        data["max_new_tokens"] = torch.tensor([2, 5, 12, 12, 3])
        data["seed"] = torch.tensor([1, 2, 3, 4, 5])
        skip_unless_declared(
            Capability.PER_SAMPLE_SAMPLING in caps, "per_sample_sampling", lambda: engine.generate(data)
        )
        out = engine.generate(data)
        lengths = out["generation_lengths"]
        assert (lengths <= data["max_new_tokens"]).all(), (
            f"generation_lengths {lengths.tolist()} exceed the per-sample max_new_tokens "
            f"{data['max_new_tokens'].tolist()}"
        )
        for i in (0, 2, 4):  # temperature 0 rows are greedy
            n = int(out["unpadded_sequence_lengths"][i])
            got, greedy = out["output_ids"][i, :n], greedy_out["output_ids"][i, :n]
            assert torch.equal(got, greedy), (
                f"sample {i} at temperature 0 gave {got.tolist()}, greedy decoding {greedy.tolist()}"
            )
        again = engine.generate(data)
        assert_same_tokens("the same per-sample seeds, called again", again["output_ids"], out["output_ids"])

    def test_stop_strings_per_sample(
        self,
        engine: Any,
        caps: frozenset[Capability],
        tokenizer: Any,
        batch: dict[str, torch.Tensor],
        greedy_out: dict[str, torch.Tensor],
    ) -> None:
        texts = generated_texts(tokenizer, greedy_out, batch, skip_special=True)
        stop = texts[0].strip().split(" ")[1] if len(texts[0].split()) > 1 else None
        assert stop, f"the tiny model's greedy output {texts[0]!r} is too short for this test"
        data = dict(batch, stop_strings=[[stop], None, ["never-seen"], None, None])
        skip_unless_declared(
            Capability.STOP_STRINGS in caps, "stop_strings", lambda: engine.generate(data, greedy=True)
        )
        out = engine.generate(data, greedy=True)
        base_len = greedy_out["generation_lengths"]
        ids0 = greedy_out["output_ids"][0]
        start = int(batch["input_lengths"][0])
        expected = next(
            k
            for k in range(1, int(base_len[0]) + 1)
            if stop in tokenizer.decode(ids0[start : start + k].tolist())
        )
        got = int(out["generation_lengths"][0])
        assert got == expected, (
            f"generation length of sample 0: {got}, expected {expected} (stop string {stop!r})"
        )
        assert out["stop_reasons"][0] == "stop_string", (
            f"stop reason of sample 0: {out['stop_reasons'][0]!r}, expected 'stop_string' ({stop!r})"
        )
        others, untouched = out["generation_lengths"][1:], base_len[1:]
        assert torch.equal(others, untouched), (
            f"generation lengths of samples 1-4: {others.tolist()}, expected {untouched.tolist()} as "
            "without stop strings (sample 2's 'never-seen' never occurs)"
        )


class OwnEngineSamplingTests:
    """Sampling on engines of their own (after the shared engine's tests)."""

    @pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
    def test_reference_agreement(
        self,
        request: pytest.FixtureRequest,
        dtype: str,
        make_engine: Callable[..., Any],
        greedy_out: dict[str, torch.Tensor],
        references: Callable[[str, str], Any],
        model_dir: str,
        batch: dict[str, torch.Tensor],
    ) -> None:
        if dtype == "float32":
            out = greedy_out
        else:
            with make_engine(dtype=dtype) as engine:
                out = engine.generate(batch, greedy=True)
        stats = check_against_reference(references(model_dir, dtype), out, batch, dtype)
        for k, v in stats.items():
            request.node.user_properties.append((k, v))

    def test_seeded_reproducibility(
        self, make_engine: Callable[..., Any], batch: dict[str, torch.Tensor]
    ) -> None:
        """Two fresh engines with the same seed give the same samples, call after call (one
        engine at a time)."""
        runs = []
        for _ in range(2):
            with make_engine(seed=7) as engine:
                runs.append([engine.generate(batch)["output_ids"] for _ in range(2)])
        (first_a, second_a), (first_b, second_b) = runs
        assert_same_tokens("two engines seeded 7, first calls", first_b, first_a)
        assert_same_tokens("two engines seeded 7, second calls", second_b, second_a)
        assert not torch.equal(first_a, second_a), (
            f"an engine's two calls gave the same samples {first_a.tolist()}: each call should draw new ones"
        )

    def test_stop_token_ids(
        self,
        make_engine: Callable[..., Any],
        batch: dict[str, torch.Tensor],
        greedy_out: dict[str, torch.Tensor],
    ) -> None:
        start = int(batch["input_lengths"][1])
        stop_id = int(greedy_out["output_ids"][1, start + 2])
        with make_engine(stop_token_ids=[stop_id]) as engine:
            out = engine.generate(batch, greedy=True)
        n, end = int(out["generation_lengths"][1]), int(out["unpadded_sequence_lengths"][1])
        assert n <= 3, (
            f"generation length of sample 1: {n}, expected at most 3 (stop token {stop_id} is its 3rd)"
        )
        last = int(out["output_ids"][1, end - 1])
        assert last == stop_id, f"sample 1 ends with token {last}, expected the stop token {stop_id} (kept)"
        assert out["stop_reasons"][1] == "stop_token", (
            f"stop reason of sample 1: {out['stop_reasons'][1]!r}, expected 'stop_token'"
        )

    def test_generation_config_eos_ends_generation(
        self,
        make_engine: Callable[..., Any],
        batch: dict[str, torch.Tensor],
        greedy_out: dict[str, torch.Tensor],
        model_dir: str,
        tokenizer: Any,
        tmp_path_factory: pytest.TempPathFactory,
    ) -> None:
        """Every id of the model's ``generation_config.json`` ``eos_token_id`` ends a sample (as
        in HF's ``generate``), not only the tokenizer's EOS."""
        start = int(batch["input_lengths"][1])
        eos_id = int(greedy_out["output_ids"][1, start + 2])
        variant = with_generation_config(
            model_dir, tmp_path_factory.mktemp("eos-model"), eos_token_id=[tokenizer.eos_token_id, eos_id]
        )
        with make_engine(model_name=variant) as engine:
            out = engine.generate(batch, greedy=True)
        n, end = int(out["generation_lengths"][1]), int(out["unpadded_sequence_lengths"][1])
        assert n <= 3, (
            f"generation length of sample 1: {n}, expected at most 3 (the generation config's EOS "
            f"{eos_id} is its 3rd token)"
        )
        last = int(out["output_ids"][1, end - 1])
        assert last == eos_id, f"sample 1 ends with token {last}, expected the EOS {eos_id} (kept)"
        assert out["stop_reasons"][1] == "eos", (
            f"stop reason of sample 1: {out['stop_reasons'][1]!r}, expected 'eos'"
        )

    def test_processed_logprobs(
        self,
        request: pytest.FixtureRequest,
        make_engine: Callable[..., Any],
        caps: frozenset[Capability],
        references: Callable[[str, str], Any],
        model_dir: str,
        batch: dict[str, torch.Tensor],
    ) -> None:
        """``logprobs_mode="processed"``: logprobs of the tempered distribution that was sampled."""
        overrides = {"logprobs_mode": "processed", "temperature": 0.7}
        skip_unless_declared(
            Capability.PROCESSED_LOGPROBS in caps, "processed_logprobs", lambda: make_engine(**overrides)
        )
        with make_engine(**overrides) as engine:
            out = engine.generate(batch)
        lengths = batch["input_lengths"]
        ref = teacher_forced_logprobs(
            references(model_dir, "float32"),
            out["output_ids"],
            lengths,
            out["unpadded_sequence_lengths"],
            0.7,
        )
        stats = agreement(out["logprobs"], ref, generated_mask(out, lengths))
        request.node.user_properties.extend(stats.items())
        bound = fp32_bound()["max_abs"]
        assert stats["max_abs"] <= bound, (
            f"processed logprobs at temperature 0.7 against the reference: max |dlogp| "
            f"{stats['max_abs']:.4g} above {bound} (all measures: {stats})"
        )
