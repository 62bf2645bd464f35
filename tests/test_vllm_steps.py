"""The vLLM worker extension's step lock (``RollgenWorkerExtension.rollgen_steps``): what a rank's
refit channel does (an adapter version written while samples of other versions decode) falls
between two of its engine's steps. The worker is a stand-in with a step of its own (vLLM's step
cannot be held at a chosen point); each test holds one side, waits until the other has arrived at
the lock, then lets go: with the lock the other side sees the first ended, without it, not."""

from __future__ import annotations

import threading
from typing import Any

from rollgen.refit.channel import DropAdapter, LoadBucket
from rollgen_vllm.extension import RollgenWorkerExtension
from tests.waiting import SAFETY_S


class SteppedWorker(RollgenWorkerExtension):
    """Stand-in for a vLLM worker: ``execute_model`` is a step that waits for ``go`` (set
    already unless a test clears it), ``rollgen_drop_adapter`` a channel request's work that
    waits for ``go_request``; each records whether the other was under way."""

    def __init__(self) -> None:
        self.go, self.go_request = threading.Event(), threading.Event()
        self.go.set()
        self.go_request.set()
        self.stepping = self.requesting = False
        self.step_saw_request: list[bool] = []
        self.request_saw_step: list[bool] = []

    def execute_model(self, scheduler_output: Any) -> Any:
        self.step_saw_request.append(self.requesting)
        self.stepping = True
        assert self.go.wait(SAFETY_S)
        self.stepping = False
        return scheduler_output

    def rollgen_drop_adapter(self, version: int) -> None:
        self.request_saw_step.append(self.stepping)
        self.requesting = True
        assert self.go_request.wait(SAFETY_S)
        self.requesting = False

    def rollgen_load_request(self, layout: str, data: bytes | None, replay: bool) -> bool:
        return layout == "held"


def arrival(worker: SteppedWorker, name: str) -> threading.Event:
    """Wrap ``worker``'s method ``name`` (already locked) with an event set as a call arrives."""
    arrived, inner = threading.Event(), getattr(worker, name)

    def call(*args: Any) -> Any:
        arrived.set()
        return inner(*args)

    setattr(worker, name, call)
    return arrived


def test_a_channel_request_waits_for_the_step_under_way() -> None:
    worker = SteppedWorker()
    steps = worker.rollgen_steps  # wraps execute_model
    worker.go.clear()
    step = threading.Thread(target=worker.execute_model, args=("out",))
    step.start()
    arrived = threading.Event()

    class Watched:  # the channel's lock, with its arrival seen
        def __enter__(self) -> None:
            arrived.set()
            steps.acquire()

        def __exit__(self, *exc: Any) -> None:
            steps.release()

    request = threading.Thread(target=worker.rollgen_answer, args=(DropAdapter(3), False, None, Watched()))
    request.start()
    assert arrived.wait(SAFETY_S)
    worker.go.set()
    step.join(SAFETY_S)
    request.join(SAFETY_S)
    assert worker.request_saw_step == [False], "the request ran while a step was under way"


def test_a_step_waits_for_the_channel_request_under_way() -> None:
    worker = SteppedWorker()
    steps = worker.rollgen_steps
    arrived = arrival(worker, "execute_model")
    worker.go_request.clear()
    request = threading.Thread(target=worker.rollgen_answer, args=(DropAdapter(3), False, None, steps))
    request.start()
    step = threading.Thread(target=worker.execute_model, args=("out",))
    step.start()
    assert arrived.wait(SAFETY_S)
    worker.go_request.set()
    request.join(SAFETY_S)
    step.join(SAFETY_S)
    assert worker.step_saw_request == [False], "a step ran while a channel request was under way"


def test_the_lock_is_made_and_the_steps_wrapped_once() -> None:
    worker = SteppedWorker()
    steps = worker.rollgen_steps
    wrapped = worker.execute_model
    assert worker.rollgen_steps is steps and worker.execute_model is wrapped
    assert wrapped("out") == "out" and not steps.locked()
    assert worker.rollgen_answer(LoadBucket("held", None), False, None, steps) is True
    assert worker.rollgen_answer(LoadBucket("other", None), False, None, steps) is False
    assert not steps.locked()
