"""Streamed rollouts: ``cancel`` (running samples, finished ones, held ones, during an update)
and closing the book, which aborts what runs and fails what is never reported. Deterministic,
over the stand-ins of ``rollout_standins``."""

from __future__ import annotations

from typing import Any

import pytest
from rollout_standins import EOS, InThread, StandInBackend, drain, rollout_take, update_in_thread

from rollgen.errors import InputError, RollgenError
from rollgen.output import STOP_REASONS
from rollgen.rollout import Rollout, SampleResult


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
