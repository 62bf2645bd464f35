"""Streamed rollouts (``async``): results as samples finish, cancellation, and weight updates
while samples run, each token stamped with the weight version that produced it.

When a cancel or an update lands depends on the machine's speed; every check here holds wherever
it lands (a sample may finish before it, or be cut after any token), and the tests record where
it landed (``*_cut_mid_sample``, ``cancel_*``). The updates run while samples decode the refit
target's untrained weights, which rarely emit EOS, so samples are usually long enough to be cut.
The cancel test runs on weights whose samples provably never end early (``one_token_model``)."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import pytest
import torch

from rollgen.conformance.checks import (
    assert_same_generation,
    assert_same_tokens,
    can_refit,
    fp32_bound,
    requires,
    skip_unless,
)
from rollgen.output import STOP_REASONS, generated_mask
from rollgen.rollout import STRAY_REPORT, Rollout, SampleResult, TokenDelta
from rollgen.spec import Capability
from rollgen.testing.reference import agreement, next_token_logprobs, one_token_model, scored_logprobs

#: Generated tokens per sample in the update tests (the budget of the untrained weights' runs).
LONG = 40
#: How many times the cancel test submits and cancels again where its cancel found no sample
#: still running (each had run to its end first), before it fails for want of one.
CANCEL_ATTEMPTS = 3


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


def check_cancelled(
    results: dict[str, list[SampleResult]], asked: dict[str, set[int]], uncut: dict[str, list[list[int]]]
) -> int:
    """Each rollout's samples (by label): a ``cancelled`` one was asked to end and holds a prefix
    of its uncut run; any other is its uncut run. Returns how many were cancelled."""
    cancelled = 0
    for label, rs in results.items():
        for r in rs:
            want = uncut[label][r.index]
            assert r.stop_reason in STOP_REASONS and r.stop_reason != "aborted", f"{label}: {r}"
            if r.stop_reason == "cancelled":
                cancelled += 1
                assert r.index in asked[label], f"{label}: {r} was not cancelled"
                assert r.token_ids == want[: len(r.token_ids)], (
                    f"{label}: cancelled {r} is not a prefix of its uncut run {want}"
                )
            else:
                assert r.token_ids == want, f"{label}: {r} differs from its uncut run {want}"
    return cancelled


@contextmanager
def served(engine: Any, weights: Any, back: Any) -> Iterator[None]:
    """The shared engine on ``weights`` (a refit), and back on ``back`` after (unless samples
    are still in flight: the test failed, and the next one gets a new engine)."""
    engine.refit(weights)
    try:
        yield
    finally:
        if not engine.samples_in_flight():
            engine.refit(back)


class StreamingTests:
    """``submit`` on the shared engine, which ends each test on its original weights, idle."""

    __requires__ = ("async",)

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
        skip_unless(caps, "async", lambda: engine.submit(batch))

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

    def test_streamed_tokens_are_the_results(
        self,
        request: pytest.FixtureRequest,
        engine: Any,
        caps: frozenset[Capability],
        batch: dict[str, torch.Tensor],
        greedy_out: dict[str, torch.Tensor],
    ) -> None:
        """``stream_tokens``: each sample's deltas, in order, hold exactly its result's tokens
        and logprobs, each stamped with the version its result says, and its result comes
        after them (a backend need not report tokens before a sample's end; ours do)."""
        self.gate(engine, caps, batch)
        rollout = engine.submit(batch, greedy=True, stream_tokens=True)
        shown: dict[int, list[TokenDelta]] = {i: [] for i in range(rollout.size)}
        ended: set[int] = set()
        for event in rollout.events():
            assert event.index not in ended, f"sample {event.index}: {event!r} after its result"
            if isinstance(event, TokenDelta):
                shown[event.index].append(event)
            else:
                ended.add(event.index)
        assert ended == set(range(rollout.size)), f"results of {sorted(ended)} of {rollout.size}"
        results = rollout.wait()
        for r in results:
            deltas = shown[r.index]
            starts = [d.start for d in deltas]
            assert starts == list(itertools.accumulate([0] + [len(d.token_ids) for d in deltas[:-1]])), (
                f"sample {r.index}: deltas start at {starts}, not one after the other from 0"
            )
            tokens = [t for d in deltas for t in d.token_ids]
            logprobs = [lp for d in deltas for lp in d.logprobs]
            assert tokens == r.token_ids, f"sample {r.index}: streamed {tokens}, its result {r.token_ids}"
            assert logprobs == r.logprobs, f"sample {r.index}: streamed logprobs {logprobs} vs {r.logprobs}"
            assert all(d.version == r.version_at(d.start) for d in deltas), (r.versions, deltas)
        request.node.user_properties.append(("streamed_deltas", sum(len(d) for d in shown.values())))
        assert_same_generation(request, "token_streamed", rollout.output(), greedy_out)

    def test_cancel(
        self,
        request: pytest.FixtureRequest,
        engine: Any,
        caps: frozenset[Capability],
        references: Callable[[str, str], Any],
        model_dir: str,
        tokenizer: Any,
        batch: dict[str, torch.Tensor],
        greedy_out: dict[str, torch.Tensor],
    ) -> None:
        """Each sample of two rollouts, one cancelled whole and one by index, is reported once: a
        cancelled one ``cancelled`` with a prefix of its uncut tokens, or (where it had ended) as
        uncut; the others as uncut. Where a refit is declared this runs on weights under which
        every greedy sample runs to its budget, all one token (``one_token_model``): the uncut
        runs are known, and the cancelled samples get the whole context as budget. A sample the
        cancel found still running (in ``Rollout.in_flight()`` just before it) must then end
        ``cancelled``: ``_stream_abort`` ends samples now. Nothing here waits on timing: a sample
        that ran to its end before the cancel is held to its uncut run only, and where the cancel
        found none running, the test submits and cancels again (``CANCEL_ATTEMPTS``); what is
        left is a sample that reaches the end of the context in the instant between that look
        and the engine's abort."""
        self.gate(engine, caps, batch)
        size, limit, lengths = batch["input_ids"].shape[0], engine.max_model_len, batch["input_lengths"]
        asked = {"one": {0}, "every": set(range(size))}
        token = tokenizer.convert_tokens_to_ids("a")
        known_runs = can_refit(caps)
        budgets = {
            "one": [limit if known_runs else LONG] + [LONG] * (size - 1),
            "every": [limit if known_runs else LONG] * size,
        }
        data = {k: {**batch, "max_new_tokens": torch.tensor(b)} for k, b in budgets.items()}
        weights: AbstractContextManager[None] = nullcontext()
        if known_runs:
            weights = served(engine, one_token_model(model_dir, token), references(model_dir, "float32"))
            uncut = {
                k: [[token] * min(b, limit - int(n)) for b, n in zip(bs, lengths)]
                for k, bs in budgets.items()
            }
        else:
            full = engine.generate(data["every"], greedy=True)
            starts, ends = lengths.tolist(), full["unpadded_sequence_lengths"].tolist()
            runs = [full["output_ids"][i, starts[i] : ends[i]].tolist() for i in range(size)]
            uncut = {"one": runs, "every": runs}
        with weights:
            attempts = 0
            while attempts < CANCEL_ATTEMPTS:
                attempts += 1
                rollouts = {k: engine.submit(d, greedy=True) for k, d in data.items()}
                running = {k: {s.index for s in r.in_flight()} & asked[k] for k, r in rollouts.items()}
                for k, r in rollouts.items():
                    r.cancel(sorted(asked[k]))
                results = {k: take_all(r) for k, r in rollouts.items()}
                cancelled = check_cancelled(results, asked, uncut)
                if not known_runs or running["every"]:
                    break
        request.node.user_properties += [
            ("cancelled_samples", cancelled),
            ("cancel_attempts", attempts),
            ("cancel_found_running", sum(len(v) for v in running.values())),
        ]
        if known_runs:
            assert running["every"], (
                f"cancel: in {CANCEL_ATTEMPTS} rollouts cancelled as soon as submitted, every sample had "
                f"ended first (each ran the whole context of {limit} before cancel was called)"
            )
            ran_on = {
                (k, r.index): (r.stop_reason, len(r.token_ids))
                for k, rs in results.items()
                for r in rs
                if r.index in running[k] and r.stop_reason != "cancelled"
            }
            assert not ran_on, (
                f"cancel: samples (rollout, index) {sorted(ran_on)} were still running when cancel was "
                f"called, with the rest of the context ahead, and ran on to their own ends (stop reason, "
                f"tokens): {ran_on}. _stream_abort must end them now (reported aborted=True with the "
                "tokens they have)"
            )
        assert_same_tokens(
            "greedy tokens after the cancels (the engine back on its weights)",
            engine.generate(batch, greedy=True)["output_ids"],
            greedy_out["output_ids"],
        )

    @requires("refit")
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
        old, new = references(model_dir, "float32"), references(other_model_dir, "float32")
        skip_unless(caps, "refit", lambda: engine.refit(new))
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
                elif mode == "wait":
                    assert versions == [running], f"wait: sample {r.index} has versions {r.versions}"
                    assert r.stop_reason not in ("aborted", "cancelled"), r
                else:
                    # abort: a sample with tokens ends with them, on the weights that made them; one
                    # the update reached before its first token starts again on the new weights
                    assert versions in ([running], [updated]), f"abort: sample {r.index} has {r.versions}"
                    assert r.stop_reason != "cancelled", r
                    assert versions == [running] or r.stop_reason != "aborted", r
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
