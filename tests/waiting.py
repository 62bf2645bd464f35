"""Waiting in tests for what a server or a generation does on its own schedule: a condition
polled under a safety net, and a generation put to sleep with a sign once a request waits for it."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

#: The longest a test waits for something that must happen (a bound, not a measure).
SAFETY_S = 60.0


def wait_until(done: Any, what: str) -> None:
    """Return once ``done()`` is true; fail, saying ``what`` did not happen, past ``SAFETY_S``."""
    deadline = time.monotonic() + SAFETY_S
    while not done():
        assert time.monotonic() < deadline, f"not within {SAFETY_S:g} s: {what}"
        time.sleep(0.02)


def asleep_until_released(gen: Any, monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Put ``gen`` to sleep (``finish_generation``); the event returned is set once a request
    waits for it to wake (its real ``wait_ready``, seen entering). The test wakes it."""
    entered = threading.Event()
    wait_ready = gen.wait_ready

    def watched(timeout_s: float | None = None) -> bool:
        entered.set()
        return bool(wait_ready(timeout_s))

    monkeypatch.setattr(gen, "wait_ready", watched)
    gen.finish_generation()
    return entered


def rollout_outcome(rollout: Any) -> Any:
    """``rollout.wait()``'s results, or the ``RollgenError`` it raised; fails (does not hang)
    where neither comes within ``SAFETY_S``."""
    from rollgen.errors import RollgenError

    out: list[Any] = []

    def wait() -> None:
        try:
            out.append(rollout.wait())
        except RollgenError as exc:
            out.append(exc)

    thread = threading.Thread(target=wait, daemon=True)
    thread.start()
    thread.join(SAFETY_S)
    assert out, f"the rollout did not end within {SAFETY_S:g} s"
    return out[0]
