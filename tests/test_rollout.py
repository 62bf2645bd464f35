"""Streamed rollouts, deterministically: the core's book-keeping (``rollgen.rollout.Streams``,
``Rollout``) and ``BaseGeneration``'s use of it, driven through stand-ins that record every
start/abort request and let the test report each sample's end at the moment it chooses. Nothing
here depends on how fast a machine decodes (the conformance suite's ``StreamingTests`` checks real
engines, where a cancel or an update lands wherever the engine happens to be); threads are ordered
with Events and Conditions, and a join with a timeout is only ever a safety net."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import pytest
import torch

import rollgen
from rollgen import Backend, BaseGeneration, BatchedDataDict, Capability, GenerationConfig, WeightBucket
from rollgen.config import validate_config
from rollgen.data import right_pad
from rollgen.errors import (
    InputError,
    RefitError,
    RollgenError,
    RolloutsInFlight,
    StaleWeights,
    UnsupportedCapability,
)
from rollgen.output import STOP_REASONS, assemble_from_lists, stop_reason
from rollgen.rollout import FinishedSample, Rollout, SampleRequest, SampleResult, Streams, UpdateMode
from rollgen.sampling import SampleParams
from rollgen.testing.config import tiny_config

#: Token ids of the stand-in backend's made-up vocabulary (``Streams`` tests).
PAD, EOS, STOP = 0, 2, 3
MAX_MODEL_LEN = 64
#: How long a thread may take to reach a point the test waits for before the test fails (never
#: a delay the outcome depends on).
DEADLINE_S = 10.0


# ---- stand-ins ------------------------------------------------------------------------------------
class Recorder:
    """A stand-in for a backend's streaming engine, not an engine: it records every
    ``start(requests)`` and ``abort(keys)`` the core asks for, never ends a sample by itself, and
    lets the test report a sample's end (``finish``) at the moment it chooses, from whichever
    thread it likes. ``on_abort``, when set, is called with each abort request's keys in the
    aborting thread (e.g. to report the cut samples at once, as an engine that stops them
    synchronously would)."""

    def __init__(self) -> None:
        self.streams: Streams | None = None
        #: Every request started, in start order.
        self.started: list[SampleRequest] = []
        #: Every abort request's keys, in order.
        self.abort_calls: list[list[str]] = []
        self.on_abort: Callable[[list[str]], None] | None = None
        self._cond = threading.Condition()

    def start(self, requests: list[SampleRequest]) -> None:
        with self._cond:
            self.started.extend(requests)
            self._cond.notify_all()

    def abort(self, keys: list[str]) -> None:
        with self._cond:
            self.abort_calls.append(list(keys))
            self._cond.notify_all()
        if self.on_abort is not None:
            self.on_abort(list(keys))

    def wait_aborts(self, count: int) -> None:
        """Return once ``count`` abort requests came (from another thread)."""
        with self._cond:
            came = self._cond.wait_for(lambda: len(self.abort_calls) >= count, DEADLINE_S)
        assert came, f"expected {count} abort request(s), got {self.abort_calls}"

    def finish(
        self,
        request: SampleRequest,
        tokens: Sequence[int],
        logprobs: Sequence[float] | None = None,
        *,
        aborted: bool = False,
        error: str | None = None,
    ) -> None:
        """Report the end of the sample started as ``request``."""
        assert self.streams is not None
        lps = tuple(logprobs) if logprobs is not None else tuple(-0.5 - t / 100 for t in tokens)
        self.streams.deliver([FinishedSample(request.key, tuple(tokens), lps, aborted, error)])


def sample_params(max_new_tokens: int = 8) -> SampleParams:
    return SampleParams(
        temperature=0.0,
        top_p=1.0,
        top_k=-1,
        max_new_tokens=max_new_tokens,
        stop_strings=(),
        stop_token_ids=(EOS, STOP),
        seed=None,
    )


class StandInBackend(Recorder):
    """The stand-in (``Recorder``) wired to a ``Streams`` of its own, with the real
    ``rollgen.output.stop_reason`` over the made-up vocabulary (EOS id 2, stop id 3, a context of
    64 tokens, no stop strings)."""

    def __init__(self) -> None:
        super().__init__()
        self.streams = Streams(self.start, self.abort, self._stop_reason)

    @staticmethod
    def _stop_reason(params: SampleParams, end: int, tokens: list[int]) -> str:
        return stop_reason(tokens, end, params, (EOS,), MAX_MODEL_LEN, lambda _: False)

    @property
    def book(self) -> Streams:
        assert self.streams is not None
        return self.streams

    def submit(
        self, prompts: Sequence[Sequence[int]], max_new_tokens: int = 8, tag: Any = None
    ) -> tuple[Rollout, list[SampleRequest]]:
        """Submit a batch as ``BaseGeneration.submit`` does; returns the rollout and the requests
        started by this call (none while an update holds new samples)."""
        ids, lengths = right_pad([list(p) for p in prompts], PAD, torch.long)
        rollout = Rollout(self.book, BatchedDataDict({"input_ids": ids, "input_lengths": lengths}), PAD, tag)
        before = len(self.started)
        self.book.submit(rollout, [tuple(p) for p in prompts], [sample_params(max_new_tokens)] * len(prompts))
        return rollout, self.started[before:]


class InThread:
    """``fn()`` in a daemon thread; ``result()`` joins it and returns its value or raises its
    exception."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self._value: Any = None
        self._error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(fn,), daemon=True)
        self.thread.start()

    def _run(self, fn: Callable[[], Any]) -> None:
        try:
            self._value = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to result()
            self._error = exc

    def still_blocked(self) -> bool:
        """Safety net only: joins briefly and says whether the thread is still running (a thread
        that should be blocked but is not would almost always have ended by then)."""
        self.thread.join(0.2)
        return self.thread.is_alive()

    def result(self) -> Any:
        self.thread.join(DEADLINE_S)
        assert not self.thread.is_alive(), "the thread did not end"
        if self._error is not None:
            raise self._error
        return self._value


def update_in_thread(
    book: Streams, mode: UpdateMode, body: Callable[[], None] = lambda: None, fresh: bool = True
) -> InThread:
    def run() -> None:
        with book.update(mode, fresh=lambda: fresh):
            body()

    return InThread(run)


def drain(rollout: Rollout) -> list[SampleResult]:
    """The results of ``rollout`` not yet taken, to its end. Each must be delivered already: a
    sample still in flight fails the test here rather than blocking it."""
    results = rollout_take(rollout, rollout.size - rollout._taken)
    assert rollout._next(block=False) is None, "a rollout yielded more results than it has samples"
    return results


def rollout_take(rollout: Rollout, count: int) -> list[SampleResult]:
    """The next ``count`` results of ``rollout``. Each must be delivered already: one that is not
    fails the test here rather than blocking it (``Rollout``'s own iteration waits for it)."""
    results: list[SampleResult] = []
    for _ in range(count):
        result = rollout._next(block=False)
        assert result is not None, f"only {len(results)} of {count} results were delivered"
        results.append(result)
    return results


def by_prompt(requests: Sequence[SampleRequest]) -> dict[tuple[int, ...], SampleRequest]:
    return {r.prompt_ids: r for r in requests}


# ---- Streams: results, order, cancel ----------------------------------------------------------------
def test_each_result_once_in_finish_order_and_wait_in_batch_order(caplog: pytest.LogCaptureFixture) -> None:
    backend = StandInBackend()
    prompts = [(5, 6), (7,), (8, 9, 10)]
    rollout, requests = backend.submit(prompts, max_new_tokens=4)
    assert [r.prompt_ids for r in requests] == prompts
    assert len({r.key for r in requests}) == 3
    assert all(r.params.max_new_tokens == 4 for r in requests)
    assert backend.book.in_flight == 3 and not rollout.done

    backend.finish(requests[2], (20, EOS), (-0.1, -0.2))
    backend.finish(requests[0], (21, 22, 23, 24), (-0.3, -0.4, -0.5, -0.6))
    with caplog.at_level(logging.WARNING, logger="rollgen.rollout"):
        backend.finish(requests[2], (99,))  # a second report of an ended sample is ignored
    assert "not running" in caplog.text
    assert backend.book.in_flight == 1 and not rollout.done
    backend.finish(requests[1], (25, STOP), (-0.7, -0.8))
    assert backend.book.in_flight == 0 and rollout.done

    assert [r.index for r in drain(rollout)] == [2, 0, 1]
    assert drain(rollout) == [], "every result is yielded once"
    results = rollout.wait()
    assert [r.index for r in results] == [0, 1, 2]
    assert [r.token_ids for r in results] == [[21, 22, 23, 24], [25, STOP], [20, EOS]]
    assert [r.logprobs for r in results] == [[-0.3, -0.4, -0.5, -0.6], [-0.7, -0.8], [-0.1, -0.2]]
    assert [r.stop_reason for r in results] == ["length", "stop_token", "eos"]
    assert all(r.versions == ((0, 0),) for r in results)

    out = rollout.output()
    assert out["stop_reasons"] == ["length", "stop_token", "eos"]
    assert out["weight_versions"] == [((0, 0),)] * 3
    assert out["generation_lengths"].tolist() == [4, 2, 2]
    assert out["unpadded_sequence_lengths"].tolist() == [6, 3, 5]
    assert out["output_ids"].tolist() == [
        [5, 6, 21, 22, 23, 24, PAD],
        [7, 25, STOP, PAD, PAD, PAD, PAD],
        [8, 9, 10, 20, EOS, PAD, PAD],
    ]
    assert out["logprobs"][1, 1:3].tolist() == pytest.approx([-0.7, -0.8])


def test_results_of_rollouts_in_one_queue_name_their_rollout() -> None:
    backend = StandInBackend()
    first, first_requests = backend.submit([(5,), (6,)], tag="step-1")
    second, second_requests = backend.submit([(7,), (8,)], tag=("step", 2))
    for request in second_requests + first_requests:
        backend.finish(request, (30, EOS))
    queue = drain(second) + drain(first)
    assert [(r.tag, r.index) for r in queue] == [
        (("step", 2), 0),
        (("step", 2), 1),
        ("step-1", 0),
        ("step-1", 1),
    ]
    assert {r.rollout_id for r in queue} == {first.rollout_id, second.rollout_id} and len(queue) == 4
    assert first.rollout_id != second.rollout_id and first.tag == "step-1"
    assert queue[0] == dataclasses.replace(queue[2], tag=None), "== compares what was generated"


@pytest.mark.parametrize("use_async", [False, True])
def test_groups_yield_whole_groups_in_completion_order_in_row_order(use_async: bool) -> None:
    """Rows 0-1 and 2-3 are two groups of 2: the group finished first comes first, once all of
    it finished, its rows in order; from threads and from asyncio alike."""
    backend = StandInBackend()
    rollout, requests = backend.submit([(5,), (6,), (7,), (8,)])
    groups = rollout.groups(2)
    got: list[list[int]] = []
    for i in (1, 3, 2):
        backend.finish(requests[i], (30 + i, EOS))

    def take(group: list[SampleResult]) -> None:
        got.append([r.index for r in group])
        if len(got) == 1:  # group 0 is not whole before its row 0 ends
            backend.finish(requests[0], (30, EOS))

    async def take_async() -> None:
        async for group in groups:
            take(group)

    if use_async:
        asyncio.run(take_async())
    else:
        for group in groups:
            take(group)
    assert got == [[2, 3], [0, 1]]
    for bad in (3, 0, True, 1.0):
        with pytest.raises(InputError, match="group size"):
            rollout.groups(bad)  # type: ignore[arg-type]


def test_blocking_iteration_yields_each_result_as_it_is_delivered() -> None:
    backend = StandInBackend()
    rollout, requests = backend.submit([(5,), (6,), (7,)])
    got: list[int] = []
    arrived = threading.Condition()

    def consume() -> None:
        for r in rollout:
            with arrived:
                got.append(r.index)
                arrived.notify_all()

    consumer = InThread(consume)
    for n, i in enumerate([1, 2, 0], start=1):
        with arrived:
            assert len(got) == n - 1, f"a result was yielded before it was delivered: {got}"
        backend.finish(requests[i], (30 + i, EOS))
        with arrived:
            assert arrived.wait_for(lambda: len(got) == n, DEADLINE_S), got  # noqa: B023 - called here
    consumer.result()
    assert got == [1, 2, 0]


def test_cancel_of_a_running_sample_yields_cancelled_with_its_partial_tokens() -> None:
    backend = StandInBackend()
    rollout, requests = backend.submit([(5,), (6,)])
    rollout.cancel(1)
    assert backend.abort_calls == [[requests[1].key]]
    assert not rollout.done, "a cancel asks the engine; the sample ends when the engine reports it"
    backend.finish(requests[1], (40, 41), (-0.1, -0.2), aborted=True)
    assert [r.index for r in rollout_take(rollout, 1)] == [1]
    backend.finish(requests[0], (42, EOS))
    results = rollout.wait()
    assert results[1] == SampleResult(1, [40, 41], [-0.1, -0.2], "cancelled", ((0, 0),))
    assert results[0].stop_reason == "eos" and results[0].token_ids == [42, EOS]
    assert "cancelled" in STOP_REASONS


def test_a_cancelled_sample_that_ended_naturally_keeps_its_stop_reason() -> None:
    backend = StandInBackend()
    rollout, requests = backend.submit([(5,), (6,)], max_new_tokens=3)
    rollout.cancel()
    assert sorted(backend.abort_calls[0]) == sorted(r.key for r in requests)
    # both ended before the engine acted on the cancel: the engine reports them as finished
    backend.finish(requests[0], (50, EOS))
    backend.finish(requests[1], (51, 52, 53))
    results = rollout.wait()
    assert [r.stop_reason for r in results] == ["eos", "length"]
    assert [r.token_ids for r in results] == [[50, EOS], [51, 52, 53]]


def test_cancel_asks_only_for_unfinished_samples_and_checks_indices() -> None:
    backend = StandInBackend()
    rollout, requests = backend.submit([(5,), (6,), (7,)])
    backend.finish(requests[0], (60, EOS))
    rollout.cancel([0])  # already ended: nothing to ask
    assert backend.abort_calls == []
    with pytest.raises(InputError, match=r"\[3, -1\]"):
        rollout.cancel([3, -1])
    with pytest.raises(InputError):
        rollout.cancel(3)
    for bad in ["0", 1.5, [0, "1"], True, b"\x00"]:
        with pytest.raises(InputError, match="cancel takes a sample index"):
            rollout.cancel(bad)  # type: ignore[arg-type]
    assert backend.abort_calls == []
    rollout.cancel()
    assert sorted(backend.abort_calls[0]) == sorted([requests[1].key, requests[2].key])
    backend.finish(requests[1], (), aborted=True)
    backend.finish(requests[2], (61,), aborted=True)
    results = rollout.wait()
    assert [r.stop_reason for r in results] == ["eos", "cancelled", "cancelled"]
    assert [r.token_ids for r in results] == [[60, EOS], [], [61]]
    out = rollout.output()
    assert out["generation_lengths"].tolist() == [2, 0, 1]


# ---- Streams: weight updates in flight ----------------------------------------------------------
def test_update_wait_blocks_until_running_samples_end_and_holds_new_ones() -> None:
    backend = StandInBackend()
    rollout, (running,) = backend.submit([(5, 6)])
    events: list[str] = []
    during: dict[str, Any] = {}

    def body() -> None:
        events.append("update applied")
        during["rollout"], during["started"] = backend.submit([(7,)])
        during["in_flight"] = backend.book.in_flight

    update = update_in_thread(backend.book, "wait", body)
    assert update.still_blocked(), "the update did not wait for the running sample"
    assert events == [] and backend.abort_calls == [], "mode='wait' neither aborts nor applies early"
    assert backend.book.version == 0

    events.append("sample delivered")
    backend.finish(running, (70, EOS))
    update.result()
    assert events == ["sample delivered", "update applied"]
    assert backend.book.version == 1
    assert during["started"] == [], "a sample submitted during an update waits for it"
    assert during["in_flight"] == 1, "a held sample counts as in flight"
    (result,) = rollout.wait()
    assert result.versions == ((0, 0),) and result.stop_reason == "eos"

    late: Rollout = during["rollout"]
    (late_request,) = backend.started[1:]
    assert late_request.prompt_ids == (7,) and late_request.params.max_new_tokens == 8
    backend.finish(late_request, (71, EOS))
    (late_result,) = late.wait()
    assert late_result.versions == ((1, 0),), "it started after the update, under the new version"


def test_update_abort_ends_running_samples_aborted_with_their_tokens() -> None:
    backend = StandInBackend()
    rollout, (a, b) = backend.submit([(5,), (6,)])
    update = update_in_thread(backend.book, "abort")
    backend.wait_aborts(1)
    assert sorted(backend.abort_calls[0]) == sorted([a.key, b.key])
    late, late_started = backend.submit([(7,)])  # while the update waits for the engine
    assert late_started == []
    assert backend.book.version == 0

    backend.finish(a, (80, 81), (-0.1, -0.2), aborted=True)
    backend.finish(b, (82, EOS))  # ended before the abort reached it
    update.result()
    assert backend.book.version == 1
    results = rollout.wait()
    assert results[0] == SampleResult(0, [80, 81], [-0.1, -0.2], "aborted", ((0, 0),))
    assert results[1].stop_reason == "eos" and results[1].versions == ((0, 0),)

    (late_request,) = backend.started[2:]  # only the held sample started: no aborted one restarted
    assert late_request.prompt_ids == (7,)
    backend.finish(late_request, (83, EOS))
    assert late.wait()[0].versions == ((1, 0),)


def test_update_keep_continues_samples_from_prompt_plus_tokens_under_the_new_version() -> None:
    backend = StandInBackend()
    rollout, (a, b) = backend.submit([(5, 6, 7), (8,)], max_new_tokens=8)
    update = update_in_thread(backend.book, "keep")
    backend.wait_aborts(1)
    assert sorted(backend.abort_calls[0]) == sorted([a.key, b.key])
    backend.finish(a, (90, 91), (-0.1, -0.2), aborted=True)
    assert update.still_blocked(), "the update did not wait for every running sample"
    backend.finish(b, (), aborted=True)  # cut before it made a token
    update.result()
    assert backend.book.version == 1
    assert not rollout.done

    restarted = by_prompt(backend.started[2:])
    assert set(restarted) == {(5, 6, 7, 90, 91), (8,)}
    a2, b2 = restarted[(5, 6, 7, 90, 91)], restarted[(8,)]
    assert a2.params.max_new_tokens == 6 and b2.params.max_new_tokens == 8
    assert a2.params == sample_params(6)
    assert {a2.key, b2.key}.isdisjoint({a.key, b.key}), "a continuation is reported under a new key"

    backend.finish(a, (99,))  # a late report under the old key is ignored
    backend.finish(a2, (92, EOS), (-0.3, -0.4))
    backend.finish(b2, (93, 94, 95, 96, 97, 98, 99, 100))
    results = rollout.wait()
    assert results[0] == SampleResult(0, [90, 91, 92, EOS], [-0.1, -0.2, -0.3, -0.4], "eos", ((0, 0), (1, 2)))
    assert [results[0].version_at(p) for p in range(4)] == [0, 0, 1, 1]
    assert results[1].versions == ((1, 0),), "no token came from version 0"
    assert results[1].stop_reason == "length" and len(results[1].token_ids) == 8
    out = rollout.output()
    assert out["weight_versions"] == [((0, 0), (1, 2)), ((1, 0),)]
    assert out["output_ids"][0, :7].tolist() == [5, 6, 7, 90, 91, 92, EOS]


def test_update_keep_counts_the_tokens_so_far_against_the_budget() -> None:
    backend = StandInBackend()
    rollout, (a,) = backend.submit([(5,)], max_new_tokens=4)
    backend.on_abort = lambda keys: backend.finish(a, (10, 11, 12), aborted=True)  # reports at once
    with backend.book.update("keep", fresh=lambda: True):
        pass
    (a2,) = backend.started[1:]
    assert a2.prompt_ids == (5, 10, 11, 12) and a2.params.max_new_tokens == 1
    backend.finish(a2, (13,))
    (result,) = rollout.wait()
    assert result.token_ids == [10, 11, 12, 13]
    assert result.stop_reason == "length", "the budget is the original one, over all segments"
    assert result.versions == ((0, 0), (1, 3))


def test_two_keep_updates_stamp_only_versions_that_made_tokens() -> None:
    backend = StandInBackend()
    rollout, (a,) = backend.submit([(5,)])
    backend.on_abort = lambda keys: backend.finish(a, (10,), aborted=True)
    with backend.book.update("keep", fresh=lambda: True):
        pass
    (a2,) = backend.started[1:]
    backend.on_abort = lambda keys: backend.finish(a2, (), aborted=True)  # nothing under version 1
    with backend.book.update("keep", fresh=lambda: True):
        pass
    (a3,) = backend.started[2:]
    assert a3.prompt_ids == (5, 10)
    backend.on_abort = None
    backend.finish(a3, (11, EOS))
    (result,) = rollout.wait()
    assert backend.book.version == 2
    assert result.versions == ((0, 0), (2, 1))
    assert result.token_ids == [10, 11, EOS]


def test_a_cancel_during_a_keep_update_ends_the_sample_cancelled() -> None:
    backend = StandInBackend()
    rollout, (a, b) = backend.submit([(5,), (6,)])
    update = update_in_thread(backend.book, "keep")
    backend.wait_aborts(1)
    rollout.cancel(0)  # asked while the update waits for the engine
    backend.finish(a, (10,), aborted=True)
    backend.finish(b, (11,), aborted=True)
    update.result()
    (b2,) = backend.started[2:]
    assert b2.prompt_ids == (6, 11)
    rollout.cancel(1)  # the continuation is cancelled under its new key
    assert backend.abort_calls[-1] == [b2.key]
    backend.finish(b2, (12,), aborted=True)
    results = rollout.wait()
    assert [(r.stop_reason, r.token_ids, r.versions) for r in results] == [
        ("cancelled", [10], ((0, 0),)),
        ("cancelled", [11, 12], ((0, 0), (1, 1))),
    ]


def test_a_failed_update_that_left_the_engine_fresh_restarts_held_samples_on_the_old_version() -> None:
    backend = StandInBackend()
    rollout, (a,) = backend.submit([(5, 6)])
    backend.on_abort = lambda keys: backend.finish(a, (10,), aborted=True)
    held: dict[str, Any] = {}
    with pytest.raises(RuntimeError, match="update failed"):
        with backend.book.update("keep", fresh=lambda: True):
            held["rollout"], held["started"] = backend.submit([(7,)])
            raise RuntimeError("update failed")
    assert held["started"] == []
    assert backend.book.version == 0
    restarted = by_prompt(backend.started[1:])
    assert set(restarted) == {(5, 6, 10), (7,)}
    backend.finish(restarted[(5, 6, 10)], (11, EOS))
    backend.finish(restarted[(7,)], (12, EOS))
    (result,) = rollout.wait()
    assert result.token_ids == [10, 11, EOS]
    assert result.versions == ((0, 0),), "every token came from version 0"
    assert held["rollout"].wait()[0].versions == ((0, 0),)
    # the book is usable: a new update runs
    with backend.book.update("wait", fresh=lambda: True):
        pass
    assert backend.book.version == 1


def test_a_failed_update_that_left_the_engine_stale_ends_held_samples_aborted() -> None:
    backend = StandInBackend()
    rollout, (a,) = backend.submit([(5, 6)])
    backend.on_abort = lambda keys: backend.finish(a, (10,), (-0.1,), aborted=True)
    held: dict[str, Any] = {}
    with pytest.raises(RuntimeError, match="half applied"):
        with backend.book.update("keep", fresh=lambda: False):
            held["rollout"], _ = backend.submit([(7,)])
            raise RuntimeError("half applied")
    assert backend.book.version == 0
    assert len(backend.started) == 1, "nothing runs on mixed weights"
    assert backend.book.in_flight == 0
    assert rollout.wait() == [SampleResult(0, [10], [-0.1], "aborted", ((0, 0),))]
    (late,) = held["rollout"].wait()
    assert late.stop_reason == "aborted" and late.token_ids == []


def test_an_invalid_update_mode_raises_before_touching_samples() -> None:
    backend = StandInBackend()
    rollout, (a,) = backend.submit([(5,)])
    with pytest.raises(InputError, match="bogus"):
        with backend.book.update("bogus", fresh=lambda: True):  # type: ignore[arg-type]
            pytest.fail("the body of an invalid update ran")
    assert backend.abort_calls == [] and backend.book.version == 0
    _, started = backend.submit([(6,)])
    assert len(started) == 1, "no update is left in progress holding new samples"
    backend.finish(a, (10, EOS))
    backend.finish(started[0], (11, EOS))
    assert rollout.wait()[0].stop_reason == "eos"


# ---- Streams: failures and shutdown -------------------------------------------------------------
def test_an_engine_error_is_raised_from_the_iteration_after_earlier_results() -> None:
    backend = StandInBackend()
    rollout, (a, b, c) = backend.submit([(5,), (6,), (7,)])
    backend.finish(a, (10, EOS))
    backend.finish(b, (11,), error="CUDA error: device-side assert")
    it = iter(rollout)
    assert next(it).index == 0
    with pytest.raises(RollgenError, match="sample 1 failed in the engine: CUDA error"):
        next(it)
    assert rollout.done
    with pytest.raises(RollgenError, match="sample 1 failed"):
        rollout.wait()
    with pytest.raises(RollgenError, match="sample 1 failed"):
        rollout.output()
    assert backend.book.in_flight == 1, "the rest of the batch still runs"
    backend.finish(c, (12, EOS))
    assert backend.book.in_flight == 0


def test_a_failing_start_fails_the_rollout_and_leaves_nothing_in_flight() -> None:
    def start(requests: list[SampleRequest]) -> None:
        raise RuntimeError("engine is gone")

    book = Streams(start, lambda keys: None, StandInBackend._stop_reason)
    ids, lengths = right_pad([[5], [6]], PAD, torch.long)
    rollout = Rollout(book, BatchedDataDict({"input_ids": ids, "input_lengths": lengths}), PAD)
    with pytest.raises(RuntimeError, match="engine is gone"):
        book.submit(rollout, [(5,), (6,)], [sample_params()] * 2)
    assert book.in_flight == 0
    with pytest.raises(RuntimeError, match="engine is gone"):
        rollout.wait()


def test_close_aborts_running_samples_and_waits_for_their_report() -> None:
    backend = StandInBackend()
    rollout, (a, b) = backend.submit([(5,), (6,)])
    closing = InThread(lambda: backend.book.close(timeout_s=60))
    backend.wait_aborts(1)
    assert sorted(backend.abort_calls[0]) == sorted([a.key, b.key])
    backend.finish(a, (10,), aborted=True)
    assert closing.still_blocked(), "close returned before the engine reported every sample"
    backend.finish(b, (11, EOS))  # ended before the abort reached it
    closing.result()
    results = rollout.wait()
    assert [(r.stop_reason, r.token_ids) for r in results] == [("aborted", [10]), ("eos", [11, EOS])]
    assert backend.book.in_flight == 0


def test_close_ends_held_samples_aborted_at_once() -> None:
    backend = StandInBackend()
    rollout, (a,) = backend.submit([(5,)])
    backend.on_abort = lambda keys: backend.finish(a, (10,), aborted=True)
    held: dict[str, Rollout] = {}
    with backend.book.update("keep", fresh=lambda: True):
        held["late"], _ = backend.submit([(6,)])
        assert backend.book.in_flight == 2  # a (to continue) and the late one, both held
        backend.book.close(timeout_s=60)
        assert backend.book.in_flight == 0
    assert len(backend.abort_calls) == 1, "close had nothing running to abort"
    assert len(backend.started) == 1, "nothing restarts after close"
    assert [(r.stop_reason, r.token_ids) for r in rollout.wait()] == [("aborted", [10])]
    assert [(r.stop_reason, r.token_ids) for r in held["late"].wait()] == [("aborted", [])]


def test_close_fails_samples_the_engine_never_reports() -> None:
    backend = StandInBackend()
    rollout, (a,) = backend.submit([(5,)])
    (listed,) = backend.book.samples()
    assert (listed.key, listed.state, listed.ending) == (a.key, "running", None), listed
    assert [s.key for s in rollout.in_flight()] == [a.key]
    backend.book.close(timeout_s=0.05)  # nothing will report a: close gives up on it
    assert backend.abort_calls == [[a.key]]
    assert backend.book.in_flight == 0 and backend.book.samples() == []
    with pytest.raises(
        RollgenError, match=f"sample 0 of rollout {rollout.rollout_id} .*without reporting it"
    ):
        rollout.wait()


# ---- Streams: asyncio ---------------------------------------------------------------------------
def test_async_iteration_yields_each_result_once_including_ones_delivered_from_a_thread() -> None:
    backend = StandInBackend()
    rollout, requests = backend.submit([(5,), (6,), (7,)])
    backend.finish(requests[1], (11, EOS))  # before the iteration starts

    def deliver_the_rest() -> None:
        backend.finish(requests[2], (12, EOS))
        backend.finish(requests[0], (10, EOS))

    delivering = threading.Thread(target=deliver_the_rest)

    async def collect() -> list[int]:
        loop = asyncio.get_running_loop()
        seen = []
        async for r in rollout:
            seen.append(r.index)
            if len(seen) == 1:
                # runs once the iteration awaits its next result: the thread delivers then
                loop.call_soon(delivering.start)
        return seen

    assert asyncio.run(asyncio.wait_for(collect(), DEADLINE_S)) == [1, 2, 0]
    delivering.join(DEADLINE_S)
    assert drain(rollout) == [], "results taken by async for are not yielded again"
    assert [r.token_ids for r in rollout.wait()] == [[10, EOS], [11, EOS], [12, EOS]]


def test_async_iteration_raises_an_engine_error() -> None:
    backend = StandInBackend()
    rollout, (a, b) = backend.submit([(5,), (6,)])
    backend.finish(a, (10, EOS))

    async def collect() -> list[int]:
        seen = []
        async for r in rollout:
            seen.append(r.index)
            backend.finish(b, (), error="out of memory")  # reported on the loop's own thread
        return seen

    with pytest.raises(RollgenError, match="sample 1 failed in the engine: out of memory"):
        asyncio.run(asyncio.wait_for(collect(), DEADLINE_S))


def test_a_cancelled_async_consumer_does_not_break_later_deliveries() -> None:
    backend = StandInBackend()
    rollout, (a, b) = backend.submit([(5,), (6,)])

    async def give_up_waiting() -> None:
        pending = asyncio.ensure_future(rollout.__aiter__().__anext__())
        for _ in range(3):
            await asyncio.sleep(0)  # let it run up to awaiting its first result
        assert not pending.done()
        pending.cancel()  # e.g. asyncio.wait_for's timeout
        with pytest.raises(asyncio.CancelledError):
            await pending

    asyncio.run(give_up_waiting())
    # later, the trainer takes the results from a thread instead
    assert backend.streams is not None
    backend.streams.deliver(
        [FinishedSample(a.key, (10, EOS), (-0.1, -0.2)), FinishedSample(b.key, (11, EOS), (-0.1, -0.2))]
    )
    assert backend.book.in_flight == 0
    assert [r.stop_reason for r in rollout.wait()] == ["eos", "eos"]


# ---- BaseGeneration over the book ---------------------------------------------------------------
class PlainGeneration(BaseGeneration):
    """A stand-in engine, not a backend: ``BaseGeneration`` on the tiny model's config without
    streaming hooks of its own; ``_generate`` answers every sample with one EOS token and
    ``_apply_bucket`` counts buckets (or raises, when ``fail_apply`` is set)."""

    local_transport = "tensors"

    def __init__(self, config: Mapping[str, Any], cluster: Any = None, backend: Any = None) -> None:
        super().__init__(config, cluster=cluster, backend=backend)
        self.applied = 0
        self.fail_apply = False

    def _generate(self, batch: BatchedDataDict[Any], params: list[SampleParams]) -> BatchedDataDict[Any]:
        eos = self.model_info.eos_token_ids[0]
        return assemble_from_lists(
            batch["input_ids"],
            batch["input_lengths"],
            [[eos]] * batch.size,
            [[-0.5]] * batch.size,
            self.cfg["pad_token_id"],
        )

    def _apply_bucket(self, bucket: WeightBucket) -> None:
        if self.fail_apply:
            raise RuntimeError("the engine lost a bucket")
        self.applied += 1


class StandInGeneration(PlainGeneration):
    """``PlainGeneration`` whose streaming hooks are a ``Recorder``: a submitted sample stays in
    flight until the test reports its end (``self.rec.finish``)."""

    def __init__(self, config: Mapping[str, Any], cluster: Any = None, backend: Any = None) -> None:
        self.rec = Recorder()
        super().__init__(config, cluster=cluster, backend=backend)
        self.rec.streams = self._streams

    def _stream_start(self, requests: list[SampleRequest]) -> None:
        self.rec.start(requests)

    def _stream_abort(self, keys: list[str]) -> None:
        self.rec.abort(keys)


ALL_CAPS = frozenset({Capability.LOGPROBS, Capability.ASYNC, Capability.SLEEP_WAKE, Capability.REFIT_TENSORS})


@pytest.fixture(scope="module")
def standin_config() -> dict[str, Any]:
    return validate_config(tiny_config("standin", dtype="float32"), GenerationConfig)


def make(cls: type[PlainGeneration], config: dict[str, Any], caps: frozenset[Capability] = ALL_CAPS) -> Any:
    backend = Backend("standin", "tests.test_rollout:StandInGeneration", GenerationConfig, caps)
    return cls(config, backend=backend)


def prompts_batch(*prompts: Sequence[int], pad: int) -> dict[str, torch.Tensor]:
    ids, lengths = right_pad([list(p) for p in prompts], pad, torch.long)
    return {"input_ids": ids, "input_lengths": lengths}


def zero_weights(engine: BaseGeneration) -> dict[str, torch.Tensor]:
    """A complete, finite state dict for the served model (one tensor per tied group)."""
    spec = engine.weight_spec
    return {
        name: torch.zeros(shape, dtype=getattr(torch, dtype))
        for name, (shape, dtype) in spec.items()
        if name not in spec.tied
    }


def test_generate_and_sleep_raise_while_streamed_samples_are_in_flight(standin_config: dict) -> None:
    gen = make(StandInGeneration, standin_config)
    pad = standin_config["pad_token_id"]
    eos = gen.model_info.eos_token_ids[0]
    batch = prompts_batch([5, 6, 7], [8], pad=pad)
    rollout = gen.submit(batch, greedy=True)
    a, b = gen.rec.started
    assert a.prompt_ids == (5, 6, 7) and b.prompt_ids == (8,)
    with pytest.raises(RolloutsInFlight, match="2 streamed sample"):
        gen.generate(batch)
    with pytest.raises(RolloutsInFlight, match="finish_generation"):
        gen.finish_generation()

    rollout.cancel()  # a cancel asks the engine; the samples are in flight until it reports them
    with pytest.raises(RolloutsInFlight):
        gen.generate(batch)
    gen.rec.finish(a, (10,), aborted=True)
    with pytest.raises(RolloutsInFlight, match="1 streamed sample"):
        gen.generate(batch)
    gen.rec.finish(b, (11, eos))
    assert [r.stop_reason for r in rollout.wait()] == ["cancelled", "eos"]

    out = gen.generate(batch)
    assert out["generation_lengths"].tolist() == [1, 1]
    gen.finish_generation()
    gen.shutdown()


def test_submit_needs_the_async_capability(standin_config: dict) -> None:
    no_async = make(StandInGeneration, standin_config, ALL_CAPS - {Capability.ASYNC})
    batch = prompts_batch([5, 6], pad=standin_config["pad_token_id"])
    with pytest.raises(UnsupportedCapability, match="async"):
        no_async.submit(batch)
    assert no_async.rec.started == [] and no_async._streams.in_flight == 0
    assert no_async.generate(batch)["generation_lengths"].tolist() == [1]

    # a backend that declares async without implementing the hooks fails the submit cleanly
    no_hooks = make(PlainGeneration, standin_config)
    with pytest.raises(UnsupportedCapability, match="async"):
        no_hooks.submit(batch)
    assert no_hooks.generate(batch)["generation_lengths"].tolist() == [1], "nothing left in flight"


def test_submit_on_the_example_backend_raises_unsupported_capability() -> None:
    pytest.importorskip("rollgen_example")
    with rollgen.create_generation(tiny_config("example", max_new_tokens=2)) as gen:
        assert Capability.ASYNC not in gen.capabilities
        batch = prompts_batch([5, 6], pad=gen.cfg["pad_token_id"])
        with pytest.raises(UnsupportedCapability, match="async"):
            gen.submit(batch)
        assert gen.weight_version == 0


def test_refit_waits_by_default_for_samples_in_flight(standin_config: dict) -> None:
    gen = make(StandInGeneration, standin_config)
    source = zero_weights(gen)
    eos = gen.model_info.eos_token_ids[0]
    rollout = gen.submit(prompts_batch([5, 6], pad=standin_config["pad_token_id"]), greedy=True)
    (a,) = gen.rec.started
    refit = InThread(lambda: gen.refit(source))
    assert refit.still_blocked(), "refit did not wait for the sample in flight"
    assert gen.applied == 0 and gen.weight_version == 0 and gen.rec.abort_calls == []
    gen.rec.finish(a, (10, eos))
    refit.result()
    assert gen.applied > 0 and gen.weight_version == 1
    assert rollout.wait()[0].versions == ((0, 0),)


def test_refit_keep_continues_a_sample_under_the_new_version(standin_config: dict) -> None:
    gen = make(StandInGeneration, standin_config)
    source = zero_weights(gen)
    eos = gen.model_info.eos_token_ids[0]
    rollout = gen.submit(prompts_batch([5, 6, 7], pad=standin_config["pad_token_id"]), greedy=True)
    (a,) = gen.rec.started
    budget = a.params.max_new_tokens
    gen.rec.on_abort = lambda keys: gen.rec.finish(a, (10, 11), aborted=True)
    InThread(lambda: gen.refit(source, mode="keep")).result()  # the thread: a deadline if it hung
    assert gen.weight_version == 1 and gen.applied > 0
    assert gen.rec.abort_calls == [[a.key]]
    (a2,) = gen.rec.started[1:]
    assert a2.prompt_ids == (5, 6, 7, 10, 11) and a2.params.max_new_tokens == budget - 2
    gen.rec.finish(a2, (12, eos))
    (result,) = rollout.wait()
    assert result.token_ids == [10, 11, 12, eos] and result.stop_reason == "eos"
    assert result.versions == ((0, 0), (1, 2))
    assert rollout.output()["weight_versions"] == [((0, 0), (1, 2))]


def test_a_refit_failing_midway_ends_kept_samples_aborted_and_keeps_the_version(standin_config: dict) -> None:
    gen = make(StandInGeneration, standin_config)
    source = zero_weights(gen)
    batch = prompts_batch([5, 6], pad=standin_config["pad_token_id"])
    rollout = gen.submit(batch, greedy=True)
    (a,) = gen.rec.started
    gen.rec.on_abort = lambda keys: gen.rec.finish(a, (10,), aborted=True)
    gen.fail_apply = True
    with pytest.raises(RuntimeError, match="lost a bucket"):
        InThread(lambda: gen.refit(source, mode="keep")).result()
    assert gen.weight_version == 0
    assert len(gen.rec.started) == 1, "a stale engine restarts nothing"
    assert [(r.stop_reason, r.token_ids) for r in rollout.wait()] == [("aborted", [10])]
    with pytest.raises(StaleWeights):
        gen.submit(batch)
    gen.fail_apply = False
    gen.refit(source)  # a complete refit makes it fresh again
    assert gen.weight_version == 1
    gen.submit(batch)
    assert gen.rec.started[-1].prompt_ids == (5, 6)


def test_a_rejected_refit_leaves_samples_running(standin_config: dict) -> None:
    gen = make(StandInGeneration, standin_config)
    source = zero_weights(gen)
    rollout = gen.submit(prompts_batch([5, 6], pad=standin_config["pad_token_id"]))
    (a,) = gen.rec.started
    name = next(iter(source))
    with pytest.raises(RefitError):
        gen.refit({**source, name: torch.zeros(3, 3)}, mode="abort")
    with pytest.raises(InputError, match="bogus"):
        gen.refit(source, mode="bogus")
    assert gen.rec.abort_calls == [] and gen.weight_version == 0 and gen.applied == 0
    assert gen._streams.in_flight == 1
    gen.rec.finish(a, (10,), aborted=True)  # e.g. the engine stopped it on its own
    assert rollout.wait()[0].stop_reason in STOP_REASONS


def test_wait_ready_returns_once_woken_refitted_fresh_or_shut_down(standin_config: dict) -> None:
    """``wait_ready`` (what the server waits in for a sleeping engine): it returns when the
    trainer's call that makes the generation ready ends, or False once it never can be."""
    gen = make(PlainGeneration, standin_config)
    source = zero_weights(gen)
    assert gen.ready and gen.wait_ready(0)
    gen.finish_generation()
    assert not gen.ready and not gen.wait_ready(0)
    waiter = InThread(gen.wait_ready)
    gen.prepare_for_generation(["weights"])
    assert not gen.ready, "the KV cache is still asleep"
    gen.prepare_for_generation()
    assert waiter.result() is True

    gen.fail_apply = True
    with pytest.raises(RuntimeError, match="lost a bucket"):
        gen.refit(source)
    assert not gen.ready and not gen.wait_ready(0), "stale weights"
    waiter = InThread(gen.wait_ready)
    gen.fail_apply = False
    gen.refit(source)
    assert waiter.result() is True

    gen.finish_generation()
    waiter = InThread(gen.wait_ready)
    gen.shutdown()
    assert waiter.result() is False and not gen.ready


def test_shutdown_ends_streamed_samples_aborted(standin_config: dict) -> None:
    gen = make(StandInGeneration, standin_config)
    rollout = gen.submit(prompts_batch([5, 6], [7], pad=standin_config["pad_token_id"]))
    a, b = gen.rec.started

    def stop_both(keys: list[str]) -> None:
        for r in (a, b):
            gen.rec.finish(r, (10,), aborted=True)

    gen.rec.on_abort = stop_both
    gen.shutdown()
    assert sorted(gen.rec.abort_calls[0]) == sorted([a.key, b.key])
    assert [(r.stop_reason, r.token_ids) for r in rollout.wait()] == [("aborted", [10])] * 2
    gen.shutdown()  # a second shutdown does nothing
    assert len(gen.rec.abort_calls) == 1


# ---- the hf backend -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def hf_engine() -> Any:
    with rollgen.create_generation(tiny_config("hf", dtype="float32", hf_cfg={"device": "cpu"})) as gen:
        yield gen


def test_hf_weight_version_counts_refits_and_stamps_streamed_tokens(hf_engine: Any) -> None:
    engine = hf_engine
    state = {k: v.detach().clone() for k, v in engine.model.state_dict().items()}
    before = engine.weight_version
    engine.refit(state)
    assert engine.weight_version == before + 1
    engine.refit(state)
    assert engine.weight_version == before + 2
    with pytest.raises(InputError):
        engine.refit(state, mode="sometimes")
    assert engine.weight_version == before + 2, "a rejected refit is not counted"

    batch = prompts_batch([5, 6, 7], [8, 9], pad=engine.cfg["pad_token_id"])
    out = engine.submit(batch, greedy=True).output()
    assert out["weight_versions"] == [((before + 2, 0),)] * 2
    expected = engine.generate(batch, greedy=True)
    assert torch.equal(out["output_ids"], expected["output_ids"])
    assert out["stop_reasons"] == expected["stop_reasons"]


def test_hf_rollouts_feeding_one_queue_in_whole_groups(hf_engine: Any) -> None:
    """Two tagged rollouts of two prompts times two samples each, forwarded group by group into
    one asyncio queue (as an async GRPO trainer takes them): every group whole, each result
    naming its rollout."""
    engine = hf_engine
    batch = prompts_batch([5, 6, 7], [5, 6, 7], [8, 9], [8, 9], pad=engine.cfg["pad_token_id"])

    async def run() -> list[list[SampleResult]]:
        queue: asyncio.Queue[list[SampleResult]] = asyncio.Queue()

        async def forward(rollout: Rollout) -> None:
            async for group in rollout.groups(2):
                await queue.put(group)

        rollouts = [engine.submit(batch, tag=f"step-{i}") for i in range(2)]
        await asyncio.gather(*(forward(r) for r in rollouts))
        return [queue.get_nowait() for _ in range(queue.qsize())]

    groups = asyncio.run(run())
    assert sorted((g[0].tag, [r.index for r in g]) for g in groups) == [
        ("step-0", [0, 1]),
        ("step-0", [2, 3]),
        ("step-1", [0, 1]),
        ("step-1", [2, 3]),
    ]
    assert all(len({r.rollout_id for r in g}) == 1 and all(r.token_ids for r in g) for g in groups)


def test_hf_takes_replica_0_or_none_and_reports_no_replica(hf_engine: Any) -> None:
    batch = prompts_batch([5, 6, 7], pad=hf_engine.cfg["pad_token_id"])
    for bad in (1, -1, True, "0"):
        with pytest.raises(InputError, match="replica"):
            hf_engine.submit(batch, replica=bad)
    assert hf_engine.replica_load() == []
    (result,) = hf_engine.submit(batch, greedy=True, replica=0).wait()
    assert result.replica is None and result.token_ids


def test_hf_generate_raises_while_a_rollout_is_in_flight(hf_engine: Any) -> None:
    engine = hf_engine
    batch = prompts_batch([5, 6, 7], pad=engine.cfg["pad_token_id"])
    # Holding the core's book lock (re-entrant) keeps the decoding thread from reporting the
    # sample, so it is in flight whatever the machine's speed; released, the sample ends.
    with engine._streams._cond:
        rollout = engine.submit(batch, greedy=True)
        with pytest.raises(RolloutsInFlight):
            engine.generate(batch, greedy=True)
        with pytest.raises(RolloutsInFlight):
            engine.finish_generation()
        assert not rollout.done
    (result,) = rollout.wait()
    assert result.stop_reason in STOP_REASONS and result.token_ids
    expected = engine.generate(batch, greedy=True)
    assert expected["output_ids"][0, 3 : 3 + len(result.token_ids)].tolist() == result.token_ids
    assert expected["stop_reasons"] == [result.stop_reason]


def test_a_kept_sample_that_ended_as_it_was_cut_is_finished_not_continued() -> None:
    """An engine may report a sample it was asked to cut with its last token an EOS or its
    budget spent (a race between its last step and the abort): there is nothing to continue."""
    backend = StandInBackend()
    rollout, (eos_req, full_req, open_req) = backend.submit([(5,), (6,), (7,)], max_new_tokens=3)

    def cut_all(keys: list[str]) -> None:
        for r, t in ((eos_req, [9, EOS]), (full_req, [9, 9, 9]), (open_req, [9])):
            backend.finish(r, t, aborted=True)

    backend.on_abort = cut_all
    started = len(backend.started)
    update_in_thread(backend.book, "keep").result()
    (open2,) = backend.started[started:]
    assert open2.prompt_ids == (7, 9)  # only the open one goes on
    results = {r.index: r for r in rollout_take(rollout, 2)}
    assert results[0].stop_reason == "eos" and results[1].stop_reason == "length"
    assert results[0].versions == results[1].versions == ((0, 0),)
    assert not rollout.done, "the open one is still in flight"
    backend.on_abort = None
    backend.finish(open2, [EOS])
    (last,) = drain(rollout)
    assert last.index == 2 and last.token_ids == [9, EOS] and last.versions == ((0, 0), (1, 1))


def test_a_sample_cancelled_before_it_started_has_the_version_it_would_have_run_under() -> None:
    backend = StandInBackend()
    running, (request,) = backend.submit([(5,)])
    during: dict[str, Any] = {}

    def body() -> None:  # the update is in progress: a new sample is held until it ends
        held, during["started"] = backend.submit([(6,)])
        held.cancel()
        (during["result"],) = drain(held)

    update = update_in_thread(backend.book, "wait", body)
    backend.finish(request, [9, EOS])
    update.result()
    assert during["started"] == [] and backend.abort_calls == [], "it never reached the engine"
    result: SampleResult = during["result"]
    assert result.stop_reason == "cancelled" and result.token_ids == [] and result.versions == ((0, 0),)
    assert result.version_at(0) == 0
    assert backend.book.version == 1 and len(backend.started) == 1 and backend.book.in_flight == 0
    assert running.wait()[0].stop_reason == "eos"


def test_a_report_whose_logprobs_do_not_match_its_tokens_fails_that_rollout_only() -> None:
    backend = StandInBackend()
    bad, (b,) = backend.submit([(5,)])
    good, (g,) = backend.submit([(6,)])
    backend.finish(b, (30, 31, EOS), (-0.1, -0.2))
    backend.finish(g, (32, EOS))
    with pytest.raises(rollgen.OutputError, match="2 logprobs for 3 tokens"):
        bad.wait()
    assert [r.token_ids for r in good.wait()] == [[32, EOS]]
    assert backend.book.in_flight == 0


def test_a_streamed_nan_logprob_makes_the_next_complete_refit_clear_the_kv_cache(
    standin_config: dict,
) -> None:
    class Clearing(StandInGeneration):
        cleared = 0

        def _clear_kv_cache(self) -> None:
            self.cleared += 1

    gen = make(Clearing, standin_config)
    eos = gen.model_info.eos_token_ids[0]
    rollout = gen.submit(prompts_batch([5, 6], pad=standin_config["pad_token_id"]), greedy=True)
    (a,) = gen.rec.started
    gen.rec.finish(a, (10, eos), (float("nan"), -0.2))
    assert rollout.wait()[0].logprobs[1] == -0.2
    source = zero_weights(gen)
    gen.refit(source, partial=False)
    assert gen.cleared == 1
    gen.refit(source)
    assert gen.cleared == 1, "the KV cache is cleared once, by the first complete refit after"
    gen.shutdown()
