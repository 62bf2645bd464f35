"""The vLLM worker extension's step lock (``RollgenWorkerExtension.rollgen_steps``): what a rank's
refit channel does (an adapter version written while samples of other versions decode) falls
between two of its engine's steps. The worker is a stand-in whose model runner's step is its own
(vLLM's step cannot be held at a chosen point): each test lets one side into its work and holds
it there, waits until the other side has arrived at the lock, then lets go. With the lock the
other side finds the first one's work ended; without it, under way. (On real vLLM,
``tests/test_adapters_ray.py`` checks that every step of a generate holds the lock.)"""

from __future__ import annotations

import threading
from typing import Any

from rollgen.refit.channel import DropAdapter, LoadBucket
from rollgen_vllm.extension import RollgenWorkerExtension
from tests.waiting import SAFETY_S


class SteppedWorker(RollgenWorkerExtension):
    """Stand-in for a vLLM worker: its model runner's ``execute_model`` is a step that waits for
    ``go`` (set unless a test clears it); ``rollgen_drop_adapter`` a channel request's work that
    waits for ``go_request``; each records whether the other was under way, and says it is under
    way itself (``stepping``, ``requesting`` events)."""

    def __init__(self) -> None:
        self.go, self.go_request = threading.Event(), threading.Event()
        self.go.set()
        self.go_request.set()
        self.stepping, self.requesting = threading.Event(), threading.Event()
        self.step_saw_request: list[bool] = []
        self.request_saw_step: list[bool] = []
        self.model_runner = self.Runner(self)

    class Runner:
        def __init__(self, worker: SteppedWorker) -> None:
            self.worker = worker

        def execute_model(self, scheduler_output: Any) -> Any:
            w = self.worker
            w.step_saw_request.append(w.requesting.is_set())
            w.stepping.set()
            assert w.go.wait(SAFETY_S)
            w.stepping.clear()
            return scheduler_output

    def rollgen_drop_adapter(self, version: int) -> None:
        self.request_saw_step.append(self.stepping.is_set())
        self.requesting.set()
        assert self.go_request.wait(SAFETY_S)
        self.requesting.clear()

    def rollgen_load_request(self, layout: str, data: bytes | None, replay: bool) -> bool:
        return layout == "held"


SETUP = {"r": 4, "lora_alpha": 8}


def arrival(lock: threading.Lock) -> tuple[Any, threading.Event]:
    """A stand-in for ``lock`` (a context manager) that says when a thread arrives at it."""
    arrived = threading.Event()

    class Watched:
        def __enter__(self) -> None:
            arrived.set()
            lock.acquire()

        def __exit__(self, *exc: Any) -> None:
            lock.release()

    return Watched(), arrived


def one_then_the_other(
    first: Any, under_way: threading.Event, release: threading.Event, second: Any, arrived: threading.Event
) -> None:
    """Start ``first`` (held until ``release``); once it is ``under_way``, start ``second``; once
    that has ``arrived`` at the lock, let ``first`` go; both end."""
    release.clear()
    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    threads[0].start()
    assert under_way.wait(SAFETY_S), "the first side did not start"
    threads[1].start()
    assert arrived.wait(SAFETY_S), "the second side did not reach the lock"
    release.set()
    for thread in threads:
        thread.join(SAFETY_S)


def test_a_channel_request_waits_for_the_step_under_way() -> None:
    worker = SteppedWorker()
    steps = worker.rollgen_steps  # wraps the runner's execute_model
    watched, arrived = arrival(steps)
    one_then_the_other(
        lambda: worker.model_runner.execute_model("out"),
        worker.stepping,
        worker.go,
        lambda: worker.rollgen_answer(DropAdapter(3), False, SETUP, watched),
        arrived,
    )
    assert worker.request_saw_step == [False], "the request ran while a step was under way"


def test_a_step_waits_for_the_channel_request_under_way() -> None:
    worker = SteppedWorker()
    steps = worker.rollgen_steps
    locked_step = worker.model_runner.execute_model
    arrived = threading.Event()

    def step() -> None:  # arrives at the step's lock
        arrived.set()
        locked_step("out")

    one_then_the_other(
        lambda: worker.rollgen_answer(DropAdapter(3), False, SETUP, steps),
        worker.requesting,
        worker.go_request,
        step,
        arrived,
    )
    assert worker.step_saw_request == [False], "a step ran while a channel request was under way"


def test_the_lock_is_made_and_the_steps_wrapped_once() -> None:
    worker = SteppedWorker()
    steps = worker.rollgen_steps
    wrapped = worker.model_runner.execute_model
    assert worker.rollgen_steps is steps and worker.model_runner.execute_model is wrapped
    assert wrapped("out") == "out" and not steps.locked()
    assert worker.rollgen_answer(LoadBucket("held", None), False, None, steps) is True
    assert worker.rollgen_answer(LoadBucket("other", None), False, None, steps) is False
    assert not steps.locked()
