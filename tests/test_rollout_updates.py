"""Weight updates that meet streamed samples in flight: ``wait``, ``abort`` and ``keep`` (the
continuation, its budget, the versions stamped), failed updates, a bad mode. Deterministic, over
the stand-ins of ``rollout_standins``."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from rollout_standins import (
    EOS,
    StandInBackend,
    by_prompt,
    drain,
    rollout_take,
    sample_params,
    update_in_thread,
)

from rollgen.errors import InputError
from rollgen.rollout import Rollout, SampleResult


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


def test_update_abort_restarts_a_started_sample_with_no_token_on_the_new_weights() -> None:
    """A sample the engine started but that made no token when an ``abort`` update came loses
    nothing by starting again: it runs on the new weights rather than ending empty."""
    backend = StandInBackend()
    rollout, (empty, some) = backend.submit([(5,), (6,)])
    update = update_in_thread(backend.book, "abort")
    backend.wait_aborts(1)
    backend.finish(empty, (), aborted=True)
    backend.finish(some, (90,), (-0.3,), aborted=True)
    update.result()
    (again,) = backend.started[2:]
    assert again.prompt_ids == (5,) and again.params.max_new_tokens == 8 and again.key != empty.key
    backend.finish(again, (91, EOS))
    first, second = rollout.wait()
    assert first.token_ids == [91, EOS] and first.stop_reason == "eos"
    assert first.versions == ((1, 0),), "stamped with the version it ran under"
    assert second.stop_reason == "aborted" and second.token_ids == [90]


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
    # continued under the new version, which keys an engine's cached prefixes
    assert a2.params == dataclasses.replace(sample_params(6), weight_version=1)
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
