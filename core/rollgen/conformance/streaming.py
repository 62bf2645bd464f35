"""Streamed rollouts (``async``): results as samples finish, cancellation, and weight updates
while samples run, each token stamped with the weight version that produced it.

When a cancel or an update lands depends on the machine's speed; every check here holds wherever
it lands (a sample may finish before it, or be cut after any token), and the tests record where
it landed (``*_cut_mid_sample``). The updates run while samples decode the refit target's
untrained weights, which rarely emit EOS, so samples are usually long enough to be cut."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

from rollgen.conformance.checks import (
    assert_same_generation,
    can_refit,
    fp32_bound,
    skip_unless_declared,
)
from rollgen.output import STOP_REASONS, generated_mask
from rollgen.rollout import STRAY_REPORT, Rollout, SampleResult
from rollgen.spec import Capability
from rollgen.testing.reference import agreement, next_token_logprobs, scored_logprobs

#: Generated tokens per sample in the update tests (the budget of the untrained weights' runs).
LONG = 40
#: In the cancel test, samples whose uncut run is this long must have been cut.
CUT = 100


def take_all(rollout: Rollout) -> list[SampleResult]:
    """Iterate ``rollout`` to its end, asserting every sample is yielded exactly once; results
    in batch order."""
    seen = [r.index for r in rollout]
    assert sorted(seen) == list(range(rollout.size)), (
        f"yielded sample indices {seen}, expected each of {rollout.size} once"
    )
    return rollout.wait()


def long_batch(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {**batch, "max_new_tokens": torch.full((batch["input_ids"].shape[0],), LONG)}


def check_segments(
    request: pytest.FixtureRequest,
    rollout: Rollout,
    batch: dict[str, torch.Tensor],
    weights_of: dict[int, Any],
    label: str,
) -> dict[str, Any]:
    """Each token's logprob agrees with the HF reference of the weights of its version (greedy:
    and is its argmax, or a near-tie: the reference's best is ahead of it by less than twice the
    logprob bound, where logprobs within the bound may swap them), within the suite's fp32
    bounds."""
    out = rollout.output()
    ids, lengths, ends = out["output_ids"], batch["input_lengths"], out["unpadded_sequence_lengths"]
    mask = generated_mask(out, lengths)
    version = torch.full_like(ids, -1)
    for row, segments in enumerate(out["weight_versions"]):
        for v, first in segments:
            version[row, int(lengths[row]) + first :] = v
    unknown = {int(v) for v in version[mask].unique()} - set(weights_of)
    assert not unknown, (
        f"{label}: tokens stamped with weight versions {unknown}, expected {sorted(weights_of)}"
    )
    expected = torch.zeros_like(out["logprobs"])
    top = torch.zeros_like(out["logprobs"])
    best = torch.zeros_like(ids)
    for v, model in weights_of.items():
        logp = next_token_logprobs(model, ids, ends)
        here = mask & (version == v)
        expected[here] = scored_logprobs(logp, ids, lengths, ends)[here]
        best[:, 1:][here[:, 1:]] = logp.argmax(-1)[here[:, 1:]]
        top[:, 1:][here[:, 1:]] = logp.max(-1).values[here[:, 1:]]
    stats = agreement(out["logprobs"], expected, mask)
    bound = fp32_bound()
    wrong = mask & (best != ids)
    gaps = (top - expected)[wrong]
    stats["argmax_near_ties"] = int(wrong.sum())
    assert (gaps < 2 * bound["max_abs"]).all(), (
        f"{label}: the tokens do not agree with the weights of their version (each token is stamped "
        f"with the weight version that made it): greedy tokens that are not their version's argmax at "
        f"{wrong.nonzero().tolist()}, "
        f"behind it by {gaps.tolist()} (a near-tie is below {2 * bound['max_abs']})"
    )
    for key in ("max_abs", "token_mult_prob_error"):
        assert stats[key] <= bound[key], (
            f"{label}: the tokens' logprobs do not agree with the weights of their version (each token "
            f"is stamped with the weight version that made it): {key} {stats[key]:.4g} above {bound[key]} "
            f"({stats})"
        )
    cut = sum(len(s) > 1 for s in out["weight_versions"])
    request.node.user_properties += [(f"{label}_{k}", v) for k, v in stats.items()]
    request.node.user_properties.append((f"{label}_cut_mid_sample", cut))
    return out


@contextmanager
def untrained_weights(
    engine: Any,
    caps: frozenset[Capability],
    references: Callable[[str, str], Any],
    model_dir: str,
    other: str,
) -> Iterator[bool]:
    """The shared engine on the refit target's untrained weights, whose greedy samples mostly run
    to their budget, and back on its own after (unless samples are still in flight: the test
    failed, and the next one gets a new engine); yields False (nothing changed) where the backend
    declares no refit."""
    if not can_refit(caps):
        yield False
        return
    engine.refit(references(other, "float32"))
    try:
        yield True
    finally:
        if not engine.samples_in_flight():  # else the test failed, and the engine is remade
            engine.refit(references(model_dir, "float32"))


class StreamingTests:
    """``submit`` on the shared engine, which ends each test on its original weights, idle."""

    @pytest.fixture(autouse=True)
    def reported_once(self, caplog: pytest.LogCaptureFixture) -> Iterator[None]:
        """After each test: the backend reported no sample that was not running."""
        yield
        records = caplog.get_records("setup") + caplog.get_records("call")
        strays = [r.args[0] for r in records if r.msg == STRAY_REPORT and isinstance(r.args, tuple)]
        assert not strays, (
            f"the backend reported samples {strays} that were not running: each started sample must be "
            "reported once (reported twice?)"
        )

    def gate(self, engine: Any, caps: frozenset[Capability], batch: dict[str, torch.Tensor]) -> None:
        skip_unless_declared(Capability.ASYNC in caps, "async", lambda: engine.submit(batch))

    def test_stream_equals_generate(
        self,
        request: pytest.FixtureRequest,
        engine: Any,
        caps: frozenset[Capability],
        batch: dict[str, torch.Tensor],
        greedy_out: dict[str, torch.Tensor],
    ) -> None:
        self.gate(engine, caps, batch)
        # two batches in flight at once, one taken from a thread, one from asyncio
        first, second = engine.submit(batch, greedy=True), engine.submit(batch, greedy=True)

        async def collect() -> list[int]:
            return [r.index async for r in second]

        indices = asyncio.run(collect())
        assert sorted(indices) == list(range(second.size)), f"asyncio: yielded {indices}"
        take_all(first)
        for label, rollout in (("thread", first), ("asyncio", second)):
            out = rollout.output()
            assert_same_generation(request, f"streamed_{label}", out, greedy_out)
            assert out["stop_reasons"] == greedy_out["stop_reasons"], (
                f"{label}: stop reasons {out['stop_reasons']} vs generate's {greedy_out['stop_reasons']}"
            )
            version = engine.weight_version
            assert all(v == ((version, 0),) for v in out["weight_versions"]), out["weight_versions"]
        assert (
            engine.submit(
                {"input_ids": batch["input_ids"][:0], "input_lengths": batch["input_lengths"][:0]}
            ).wait()
            == []
        )

    def test_cancel(
        self,
        request: pytest.FixtureRequest,
        engine: Any,
        caps: frozenset[Capability],
        references: Callable[[str, str], Any],
        model_dir: str,
        other_model_dir: str,
        batch: dict[str, torch.Tensor],
    ) -> None:
        """Cancelled samples end ``cancelled`` with a prefix of their uncut tokens; the others as
        ``generate`` gives them. On the untrained weights (where a refit is declared), with the
        whole context as budget, samples that run on for at least ``CUT`` tokens uncut must be
        cut by a cancel issued as soon as they were submitted: this holds unless this thread
        stalls, between ``submit`` and ``cancel``, for as long as the engine takes to decode
        that many tokens."""
        self.gate(engine, caps, batch)
        with untrained_weights(engine, caps, references, model_dir, other_model_dir) as long_runs:
            size = batch["input_ids"].shape[0]
            long = {
                **batch,
                "max_new_tokens": torch.full((size,), engine.max_model_len if long_runs else LONG),
            }
            one, every = engine.submit(long, greedy=True), engine.submit(long, greedy=True)
            one.cancel(0)
            every.cancel()
            results = {"one": take_all(one), "every": take_all(every)}
            full = engine.generate(long, greedy=True)  # usable, and the uncut samples
        start, lengths = long["input_lengths"].tolist(), full["generation_lengths"].tolist()
        cancelled = 0
        for label, asked in (("one", {0}), ("every", set(range(every.size)))):
            for r in results[label]:
                assert r.stop_reason in STOP_REASONS, r
                assert r.stop_reason != "cancelled" or r.index in asked, f"{label}: {r} was not cancelled"
                want = full["output_ids"][
                    r.index, start[r.index] : start[r.index] + lengths[r.index]
                ].tolist()
                if r.stop_reason == "cancelled":
                    cancelled += 1
                    assert r.token_ids == want[: len(r.token_ids)], (
                        f"{label}: cancelled {r} is not a prefix of {want}"
                    )
                else:
                    assert r.token_ids == want, f"{label}: {r} differs from generate's {want}"
        request.node.user_properties.append(("cancelled_samples", cancelled))
        if long_runs:
            uncut = {
                r.index: (r.stop_reason, len(r.token_ids))
                for r in results["every"]
                if lengths[r.index] >= CUT and r.stop_reason != "cancelled"
            }
            assert not uncut, (
                f"cancel: samples {sorted(uncut)} of a rollout cancelled as soon as it was submitted ran "
                f"on to their own ends (stop reason, tokens): {uncut}. _stream_abort must end them now "
                "(reported aborted=True with the tokens they have)"
            )

    @pytest.mark.parametrize("mode", ["keep", "abort", "wait"])
    def test_update_in_flight(
        self,
        request: pytest.FixtureRequest,
        mode: str,
        engine: Any,
        caps: frozenset[Capability],
        references: Callable[[str, str], Any],
        model_dir: str,
        other_model_dir: str,
        batch: dict[str, torch.Tensor],
        greedy_out: dict[str, torch.Tensor],
    ) -> None:
        self.gate(engine, caps, batch)
        if not can_refit(caps):
            pytest.skip("no refit declared")
        old, new = references(model_dir, "float32"), references(other_model_dir, "float32")
        engine.refit(new)
        try:
            running = engine.weight_version
            long = long_batch(batch)
            rollout = engine.submit(long, greedy=True)
            engine.refit(old, mode=mode)
            updated = engine.weight_version
            assert updated == running + 1, f"weight_version {running} → {updated} after one refit"
            results = take_all(rollout)
            for r in results:
                versions = [v for v, _ in r.versions]
                if mode == "keep":
                    assert versions in ([running], [running, updated], [updated]), r.versions
                    assert r.stop_reason not in ("aborted", "cancelled"), r
                else:
                    assert versions == [running], f"{mode}: sample {r.index} has versions {r.versions}"
                    if mode == "wait":
                        assert r.stop_reason not in ("aborted", "cancelled"), r
                    else:
                        assert r.stop_reason != "cancelled", r
                assert r.versions[0][1] == 0 and len(r.logprobs) == len(r.token_ids), r
            check_segments(request, rollout, long, {running: new, updated: old}, mode)
            if mode == "abort":
                aborted = [r.index for r in results if r.stop_reason == "aborted"]
                request.node.user_properties.append(("abort_aborted_samples", len(aborted)))
        finally:
            if engine.weight_version == running and not engine.samples_in_flight():
                engine.refit(old)
        assert_same_generation(
            request, f"{mode}_then_generate", engine.generate(batch, greedy=True), greedy_out
        )
