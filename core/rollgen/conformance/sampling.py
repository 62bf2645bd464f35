"""Sampling: determinism, per-sample settings, stop strings and ids, EOS, seeds, processed
logprobs and agreement with the HF reference."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch

from rollgen.conformance.checks import (
    assert_same_generation,
    assert_same_tokens,
    check_against_reference,
    fp32_bound,
    requires,
    skip_unless,
)
from rollgen.conformance.statistics import FALSE_FAILURE, implausible_counts
from rollgen.output import generated_mask
from rollgen.spec import Capability
from rollgen.testing.prompts import generated_texts
from rollgen.testing.reference import (
    agreement,
    next_token_logprobs,
    processed_logprobs,
)
from rollgen.testing.tiny_model import with_generation_config

#: The sampling settings of the statistical tests: temperature, and top-k (which the top-p
#: settings apply after). The prompt is the suite's fifth, whose next token is far from certain.
TEMPERATURE, TOP_K, PROMPT = 0.7, 4, 4
#: Seeded draws per setting in the distribution test.
DRAWS = 400
#: Top-k and top-p of the processed-logprobs test.
PROCESSED_TOP_K, PROCESSED_TOP_P = 4, 0.9


def first_token_settings(reference: Any, batch: dict[str, torch.Tensor]) -> list[tuple[str, float]]:
    """The distribution test's two settings, from the reference's distribution of the prompt's
    next token: top-p off (the top-k cut decides), and top-p halfway through the top-k
    distribution's second token (the crossing token decides, and top-k before top-p matters)."""
    n = int(batch["input_lengths"][PROMPT])
    ids = batch["input_ids"][PROMPT : PROMPT + 1, : n + 1]
    logp = next_token_logprobs(reference, ids, torch.tensor([n + 1]), TEMPERATURE)[0, n - 1]
    top = logp.topk(TOP_K).values.softmax(-1).cumsum(-1)
    return [("top-k alone (top_p 1)", 1.0), ("top-k then top-p", float(top[0] + top[1]) / 2)]


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

    @requires("per_sample_sampling")
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
        skip_unless(caps, "per_sample_sampling", lambda: engine.generate(data))
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

    def test_a_seed_alone_decides_its_sample(
        self, engine: Any, caps: frozenset[Capability], batch: dict[str, torch.Tensor]
    ) -> None:
        """A seeded sample comes out the same in another batch: the batch's rows reversed, each
        with its seed (a generator shared by the batch, or one per row position, gives other
        draws). Certain: a backend that follows the rule passes."""
        seeded = {**batch, "seed": torch.arange(101, 101 + batch["input_ids"].shape[0])}
        reverse = {k: v.flip(0) for k, v in seeded.items()}
        out, rev = engine.generate(seeded), engine.generate(reverse)
        lengths, ends = batch["input_lengths"].tolist(), out["unpadded_sequence_lengths"].tolist()
        rev_ends = rev["unpadded_sequence_lengths"].flip(0).tolist()
        rows = out["output_ids"].tolist()
        rev_rows = rev["output_ids"].flip(0).tolist()
        differ = {
            i: (rows[i][lengths[i] : ends[i]], rev_rows[i][lengths[i] : rev_ends[i]])
            for i in range(len(rows))
            if rows[i][: ends[i]] != rev_rows[i][: rev_ends[i]]
        }
        assert not differ, (
            f"seeds: samples {sorted(differ)} came out differently with the same prompt and seed in "
            f"another batch (the rows reversed): a sample must be drawn from its own seed alone, not "
            f"from a generator shared by the batch. Generated (batch, reversed batch): {differ}"
        )

    @requires("stop_strings")
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
        skip_unless(caps, "stop_strings", lambda: engine.generate(data, greedy=True))
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
            f"stop strings: sample 0 generated {got} tokens, expected {expected}: it must end at the token "
            f"that completes its stop string {stop!r}, kept"
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

    def test_sampling_distribution_and_raw_logprobs(
        self,
        request: pytest.FixtureRequest,
        make_engine: Callable[..., Any],
        caps: frozenset[Capability],
        references: Callable[[str, str], Any],
        model_dir: str,
        batch: dict[str, torch.Tensor],
    ) -> None:
        """At temperature 0.7 with top-k 4, top-p off and then top-p halfway through the second
        token, a prompt's next token drawn with seeds 0, 1, ... follows the reference's
        distribution (docs/contract.md's order: temperature, top-k, then top-p over the top-k
        distribution renormalized, the crossing token kept): no token the reference drops, and
        each kept token's count within exact binomial bounds (a correct backend fails with
        probability below 1e-6, ``statistics.FALSE_FAILURE``). Their logprobs are raw (the
        default): the unprocessed log-softmax, whatever was sampled from. On the shared engine
        with per-sample settings where declared, else on an engine per setting."""
        reference = references(model_dir, "float32")
        n = int(batch["input_lengths"][PROMPT])
        prompt = batch["input_ids"][PROMPT : PROMPT + 1, :n].expand(DRAWS, n)
        raw = next_token_logprobs(
            reference, batch["input_ids"][PROMPT : PROMPT + 1, : n + 1], torch.tensor([n + 1])
        )
        raw = raw[0, n - 1]
        tempered = next_token_logprobs(
            reference, batch["input_ids"][PROMPT : PROMPT + 1, : n + 1], torch.tensor([n + 1]), TEMPERATURE
        )[0, n - 1]
        problems: list[str] = []
        worst_raw = 0.0
        for j, (label, top_p) in enumerate(first_token_settings(reference, batch)):
            data = {
                "input_ids": prompt.contiguous(),
                "input_lengths": torch.full((DRAWS,), n),
                "seed": torch.arange(j * DRAWS, (j + 1) * DRAWS),
            }
            settings = {"temperature": TEMPERATURE, "top_k": TOP_K, "top_p": top_p, "max_new_tokens": 1}
            if Capability.PER_SAMPLE_SAMPLING in caps:
                out = request.getfixturevalue("engine").generate(
                    {**data, **{k: torch.full((DRAWS,), v) for k, v in settings.items()}}
                )
            else:
                with make_engine(**settings) as engine:
                    out = engine.generate(data)
            tokens, logprobs = out["output_ids"][:, n], out["logprobs"][:, n]
            expected, near = processed_logprobs(tempered, TOP_K, top_p)
            assert not near, (
                f"{label}: the reference's cut is within rounding of a boundary: pick another prompt"
            )
            q = {int(t): float(expected[t].exp()) for t in (expected > float("-inf")).nonzero().flatten()}
            assert min(q.values()) > 0.07, f"{label}: kept tokens too rare for {DRAWS} draws to tell: {q}"
            counts = Counter(tokens.tolist())
            request.node.user_properties.append((f"{label}: counts", dict(counts)))
            problems += implausible_counts(
                counts, q, f"{label} (temperature {TEMPERATURE}, top_k {TOP_K}, top_p {top_p:.3f})"
            )
            diff = (logprobs - raw[tokens]).abs()
            worst_raw = max(worst_raw, float(diff.max()))
            if worst_raw > fp32_bound()["max_abs"]:
                processed = expected.clamp(min=-1e4)[tokens]
                like = (
                    "processed" if (logprobs - processed).abs().max() < 1e-3 else "neither raw nor processed"
                )
                problems.append(
                    f"{label}: raw logprobs asked (the default), but the sampled tokens' logprobs are up to "
                    f"{float(diff.max()):.3g} from the unprocessed log-softmax ({like} ones?)"
                )
        request.node.user_properties.append(("raw_max_abs", worst_raw))
        assert not problems, (
            "sampling distribution:\n"
            + "\n".join(problems)
            + (f"\n(a correct backend fails this with probability below {FALSE_FAILURE})")
        )

    @requires("processed_logprobs")
    def test_processed_logprobs(
        self,
        request: pytest.FixtureRequest,
        make_engine: Callable[..., Any],
        caps: frozenset[Capability],
        references: Callable[[str, str], Any],
        model_dir: str,
        batch: dict[str, torch.Tensor],
    ) -> None:
        """``logprobs_mode="processed"``: logprobs of the distribution sampled from, at temperature
        0.7 with top-k and top-p: the reference's tempered distribution cut to the top-k, cut
        again by top-p over it renormalized (the crossing token kept), renormalized. Positions
        whose cut lies within rounding of a boundary are left out (recorded)."""
        overrides = {
            "logprobs_mode": "processed",
            "temperature": TEMPERATURE,
            "top_k": PROCESSED_TOP_K,
            "top_p": PROCESSED_TOP_P,
        }
        skip_unless(caps, "processed_logprobs", lambda: make_engine(**overrides))
        with make_engine(**overrides) as engine:
            out = engine.generate(batch)
        lengths, ends, ids = batch["input_lengths"], out["unpadded_sequence_lengths"], out["output_ids"]
        tempered = next_token_logprobs(references(model_dir, "float32"), ids, ends, TEMPERATURE)
        logp, near = processed_logprobs(tempered, PROCESSED_TOP_K, PROCESSED_TOP_P)
        ref = torch.zeros_like(out["logprobs"], dtype=torch.float64)
        ref[:, 1:] = logp.gather(-1, ids[:, 1:].clamp(max=logp.shape[-1] - 1).unsqueeze(-1)).squeeze(-1)
        mask = generated_mask(out, lengths)
        mask[:, 1:] &= ~near
        dropped = mask & (ref == float("-inf"))
        assert not dropped.any(), (
            f"processed logprobs: tokens sampled at (row, position) {dropped.nonzero().tolist()} are "
            f"outside the top-k {PROCESSED_TOP_K} / top-p {PROCESSED_TOP_P} set the reference keeps"
        )
        stats = agreement(out["logprobs"], ref.float(), mask)
        stats["near_boundary_left_out"] = int((generated_mask(out, lengths)[:, 1:] & near).sum())
        request.node.user_properties.extend(stats.items())
        bound = fp32_bound()["max_abs"]
        assert stats["max_abs"] <= bound, (
            f"processed logprobs at temperature {TEMPERATURE}, top_k {PROCESSED_TOP_K}, top_p "
            f"{PROCESSED_TOP_P} against the reference's renormalized distribution: max |dlogp| "
            f"{stats['max_abs']:.4g} above {bound} (all measures: {stats})"
        )
