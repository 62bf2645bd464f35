"""A generation put to sleep for a test, with a sign once a request waits for it to wake."""

from __future__ import annotations

import threading
from typing import Any

import pytest


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
