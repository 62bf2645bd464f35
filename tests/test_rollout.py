"""Streamed rollouts, deterministically (``rollgen.rollout.Streams``, ``Rollout``): each result
once, in finish order; rollouts feeding one queue; whole groups; blocking and async iteration;
engine errors. Driven through the stand-ins of ``rollout_standins``, which let the test report
each sample's end at the moment it chooses: nothing here depends on how fast a machine decodes
(the conformance suite's ``StreamingTests`` checks real engines)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading

import pytest
import torch
from rollout_standins import (
    DEADLINE_S,
    EOS,
    PAD,
    STOP,
    InThread,
    StandInBackend,
    drain,
    sample_params,
    update_in_thread,
)

import rollgen
from rollgen import BatchedDataDict
from rollgen.data import right_pad
from rollgen.errors import InputError, OutputError, RollgenError
from rollgen.rollout import FinishedSample, Rollout, SampleRequest, SampleResult, Streams, TokenDelta


# ---- Streams: results, order, groups ----------------------------------------------------------------
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


# ---- Streams: engine failures -------------------------------------------------------------------
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


# ---- token streaming ------------------------------------------------------------------------------
def test_streamed_tokens_come_as_deltas_then_the_result() -> None:
    """A rollout submitted with ``stream_tokens``: each sample's progress reports become deltas
    (positions and version), the tokens its end adds one more, then its result; the deltas
    hold the result's tokens; the results' own iteration is as without streaming."""
    backend = StandInBackend()
    rollout, (a, b) = backend.submit([(5,), (6,)], stream_tokens=True)
    assert a.stream_tokens and b.stream_tokens
    backend.made(a, (10, 11), (-0.1, -0.2))
    backend.made(b, (20,))
    backend.made(a, (12,))
    backend.finish(a, (10, 11, 12, 13, EOS))
    backend.finish(b, (20,), aborted=False)
    events = list(rollout.events())
    deltas = [(e.index, e.start, e.token_ids, e.version) for e in events if isinstance(e, TokenDelta)]
    assert deltas == [(0, 0, (10, 11), 0), (1, 0, (20,), 0), (0, 2, (12,), 0), (0, 3, (13, EOS), 0)]
    assert [e.index for e in events if isinstance(e, SampleResult)] == [0, 1]
    assert isinstance(events[-1], SampleResult), "a sample's result comes after its last delta"
    assert events[0].logprobs == (-0.1, -0.2)
    assert [r.index for r in drain(rollout)] == [0, 1], "the results' own iteration is unchanged"


def test_a_kept_sample_streams_its_continuation_under_the_new_version() -> None:
    """A ``keep`` update cuts a streaming sample: the tokens of the cut the engine had not
    reported yet come as a delta, its continuation's under the new version."""
    backend = StandInBackend()
    rollout, (first,) = backend.submit([(5,)], stream_tokens=True)
    backend.made(first, (10,))
    update = update_in_thread(backend.book, "keep")
    backend.wait_aborts(1)
    backend.finish(first, (10, 11), aborted=True)
    update.result()
    (second,) = backend.started[1:]
    backend.made(second, (12,))
    backend.finish(second, (12, EOS))
    got = [(e.start, e.token_ids, e.version) for e in rollout.events() if isinstance(e, TokenDelta)]
    assert got == [(0, (10,), 0), (1, (11,), 0), (2, (12,), 1), (3, (EOS,), 1)]
    (result,) = rollout.wait()
    assert result.token_ids == [10, 11, 12, EOS] and result.versions == ((0, 0), (1, 2))


def test_an_end_that_contradicts_the_reported_progress_fails_the_rollout() -> None:
    backend = StandInBackend()
    rollout, (a,) = backend.submit([(5,)], stream_tokens=True)
    backend.made(a, (10, 11))
    backend.finish(a, (10, 99, EOS))
    with pytest.raises(OutputError, match="does not start with the 2 tokens"):
        rollout.wait()


def test_events_need_stream_tokens_and_stray_progress_is_dropped() -> None:
    backend = StandInBackend()
    rollout, (a,) = backend.submit([(5,)])
    assert not a.stream_tokens
    with pytest.raises(InputError, match="stream_tokens=True"):
        rollout.events()
    backend.finish(a, (10, EOS))
    backend.made(a, (11,))  # after its end: dropped, nothing raised
    assert rollout.wait()[0].token_ids == [10, EOS]


def test_events_from_asyncio() -> None:
    backend = StandInBackend()
    rollout, (a,) = backend.submit([(5,)], stream_tokens=True)

    async def read() -> list[object]:
        seen: list[object] = []
        async for event in rollout.events():
            seen.append(event)
            if isinstance(event, TokenDelta) and event.start == 0:
                threading.Thread(target=backend.finish, args=(a, (10, EOS))).start()
        return seen

    backend.made(a, (10,))
    seen = asyncio.run(read())
    assert [type(e).__name__ for e in seen] == ["TokenDelta", "TokenDelta", "SampleResult"]
