"""``StepLoop``: the decoding thread of an engine that is stepped, shared by hf and the Ray
workers. It admits the samples handed to it, ends those asked to end, steps the engine while any
runs, reports the new tokens of samples that stream theirs after each step, and reports each
sample once it ends; a failure ends every sample it started, with the error, so none is left
unreported. Other work on the engine while samples run (an adapter's load) goes through it too
(``call``), between two steps."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from rollgen.errors import EngineClosed
from rollgen.rollout import FinishedSample, SampleProgress, SampleRequest

logger = logging.getLogger(__name__)

#: What one engine step did to one sample: its key, its new tokens and their logprobs, whether
#: it ended.
StepOutput = tuple[str, list[int], list[float], bool]


class StepLoop:
    """One thread that drives an engine through three hooks while it has samples, and reports
    what ended to ``deliver`` (from that thread).

    Args:
        add: admit one list of requests (keyed by ``SampleRequest.key``), as one batch.
        step: one engine step: a ``StepOutput`` for each sample it moved.
        abort: remove running samples from the engine (keys it no longer runs are ignored).
        deliver: takes the samples that ended in a round (``FinishedSample``; aborted ones carry
            the tokens they have).
        name: names the thread and the log lines.
        progress: takes the new tokens of the samples started with ``stream_tokens`` that a
            round moved and did not end (``SampleProgress``), before that round's ends.

    Aborts come before the step in each round: a sample that ended on its own is reported as it
    is, even if an abort came too late to stop it."""

    def __init__(
        self,
        add: Callable[[list[SampleRequest]], None],
        step: Callable[[], list[StepOutput]],
        abort: Callable[[list[str]], None],
        deliver: Callable[[list[FinishedSample]], None],
        name: str,
        progress: Callable[[list[SampleProgress]], None] = lambda reports: None,
    ) -> None:
        self._add, self._step, self._abort, self._deliver, self.name = add, step, abort, deliver, name
        self._progress = progress
        self._inbox = threading.Condition()
        self._to_start: list[list[SampleRequest]] = []
        self._to_abort: set[str] = set()
        self._calls: list[tuple[Callable[[], Any], Future[Any]]] = []
        self._stopped = False
        self._thread: threading.Thread | None = None
        #: Tokens the engine made for the samples so far (what says it is not stuck).
        self.tokens_made = 0

    def start(self, requests: list[SampleRequest]) -> None:
        """Hand ``requests`` to the thread (started on the first call); returns at once."""
        with self._inbox:
            self._to_start.append(requests)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True, name=self.name)
                self._thread.start()
            self._inbox.notify_all()

    def abort(self, keys: list[str]) -> None:
        """Have the thread end the samples ``keys`` that still run."""
        with self._inbox:
            self._to_abort.update(keys)
            self._inbox.notify_all()

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` between two steps of the engine (never beside one) and return what it
        returns, or raise what it raises; in this thread where the loop's has not started.

        Raises:
            EngineClosed: the loop was stopped (or its thread ended) before it ran ``fn``."""
        with self._inbox:
            if self._thread is None:
                return fn()
            if self._stopped or not self._thread.is_alive():
                raise EngineClosed(f"{self.name}: stopped; nothing more runs on its engine")
            done: Future[Any] = Future()
            self._calls.append((fn, done))
            self._inbox.notify_all()
        return done.result()

    def stop(self) -> None:
        """End the thread (what still runs is left unreported: the caller stops the engine)."""
        with self._inbox:
            self._stopped = True
            self._inbox.notify_all()
        if self._thread is not None:
            self._thread.join()

    def _end_calls(self) -> None:
        """Fail the calls still waiting (under the lock): the thread ends."""
        for _, done in self._calls:
            done.set_exception(EngineClosed(f"{self.name}: stopped before it ran a call"))
        self._calls = []

    def _run(self) -> None:
        try:
            self._rounds()
        finally:  # a report that raised ends the thread: no call waits for it
            with self._inbox:
                self._end_calls()

    def _rounds(self) -> None:
        running: dict[str, tuple[list[int], list[float]]] = {}
        streaming: set[str] = set()
        while True:
            with self._inbox:
                if not running:
                    self._inbox.wait_for(
                        lambda: bool(self._to_start or self._to_abort or self._calls or self._stopped)
                    )
                if self._stopped:
                    self._end_calls()
                    return
                starts, self._to_start = self._to_start, []
                aborts, self._to_abort = self._to_abort, set()
                calls, self._calls = self._calls, []
            for fn, done in calls:
                try:
                    done.set_result(fn())
                except BaseException as exc:  # noqa: BLE001 - raised in the caller's thread
                    done.set_exception(exc)
            ended: list[FinishedSample] = []
            moved: list[SampleProgress] = []
            try:
                for requests in starts:
                    self._add(requests)
                    running.update({r.key: ([], []) for r in requests})
                    streaming.update(r.key for r in requests if r.stream_tokens)
                hit = [k for k in aborts if k in running]
                if hit:
                    self._abort(hit)
                    ended += [FinishedSample(k, *_tuples(running.pop(k)), aborted=True) for k in hit]
                for key, tokens, logprobs, finished in self._step() if running else []:
                    self.tokens_made += len(tokens)
                    if key in running:
                        running[key][0].extend(tokens)
                        running[key][1].extend(logprobs)
                        if finished:
                            ended.append(FinishedSample(key, *_tuples(running.pop(key))))
                        elif tokens and key in streaming:
                            moved.append(SampleProgress(key, tuple(tokens), tuple(logprobs)))
            except Exception as exc:  # noqa: BLE001 - reported with every sample it ends
                logger.exception("%s: decoding streamed samples failed", self.name)
                error = f"{type(exc).__name__}: {exc}"
                reported = {f.key for f in ended}
                lost: dict[str, tuple[list[int], list[float]]] = {
                    r.key: ([], []) for requests in starts for r in requests
                } | running
                ended += [
                    FinishedSample(k, *_tuples(s), error=error) for k, s in lost.items() if k not in reported
                ]
                running.clear()
                try:  # the engine may still hold some of them
                    self._abort(list(lost))
                except Exception:  # noqa: BLE001 - the error above is the one reported
                    logger.debug("%s: could not abort the failed samples", self.name)
            streaming.difference_update(f.key for f in ended)
            if moved:
                self._progress(moved)
            if ended:
                self._deliver(ended)


def _tuples(sample: tuple[list[int], list[float]]) -> tuple[tuple[int, ...], tuple[float, ...]]:
    return tuple(sample[0]), tuple(sample[1])
