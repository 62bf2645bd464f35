"""The suite's per-test time limit (``--rollgen-test-timeout``): a test still running when it
expires fails, naming what it was waiting for and the streamed samples its engines never
reported, instead of hanging the run. Setup, call and teardown share the limit; a phase that
starts after it expired (the teardown of a test that ran past it) gets a grace of its own, and
cleanup that hangs after an expiry is interrupted again after each grace. A POSIX timer signal
interrupts the waiting call in the main thread; elsewhere (no ``setitimer``, or pytest not in
the main thread) tests run without a limit."""

from __future__ import annotations

import signal
import threading
import time
import traceback
import weakref
from collections.abc import Generator
from contextlib import contextmanager
from types import FrameType
from typing import Any

import pytest

#: The engines alive in the run (the suite's pools register theirs), to name what they hold.
ENGINES: weakref.WeakSet[Any] = weakref.WeakSet()
#: When the running test's limit expires (``time.monotonic()``).
DEADLINE = pytest.StashKey[float]()


def in_flight() -> list[str]:
    """Every streamed sample the live engines have not reported, described."""
    return [str(s) for engine in list(ENGINES) for s in getattr(engine, "samples_in_flight", list)()]


def _waiting_in(frame: FrameType | None) -> str:
    """The interrupted calls, innermost first, up to the test's own (or 6 of them)."""
    frames = list(reversed(traceback.extract_stack(frame)))
    tests = [i for i, f in enumerate(frames) if f.name.startswith("test_")]
    shown = frames[: min(tests[0] + 1 if tests else 6, 6)]
    return " <- ".join(f"{f.name} ({f.filename.rsplit('/', 1)[-1]}:{f.lineno}: {f.line})" for f in shown)


@contextmanager
def limited(item: pytest.Item, phase: str) -> Generator[None, None, None]:
    """Run one phase of ``item`` within what is left of its limit."""
    limit = item.config.getoption("--rollgen-test-timeout", default=None)
    usable = hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()
    if not limit or not usable:
        yield
        return
    if phase == "setup":
        item.stash[DEADLINE] = time.monotonic() + limit
    grace = min(limit, 60.0)
    left = max(
        item.stash.get(DEADLINE, time.monotonic() + limit) - time.monotonic(),
        grace if phase == "teardown" else 0.001,
    )

    def expire(signum: int, frame: FrameType | None) -> None:
        samples = in_flight()
        stuck = "\n  ".join(samples) if samples else "none"
        pytest.fail(
            f"{item.nodeid} ran past --rollgen-test-timeout={limit:g} s (in its {phase}); it was waiting "
            f"in {_waiting_in(frame)}.\nStreamed samples in flight, never reported:\n  {stuck}",
            pytrace=True,
        )

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, left, grace)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
