"""``SampleDispatcher``: the driver's side of streamed samples on engines in Ray actors. Samples
go to the engine with the most free room (``EngineWorker._capacity`` each), wait on the driver
when every engine is full, and go out as engines free up; a thread polls the engines that have
samples and hands what ended to the core, and an engine's failure to the generation."""

from __future__ import annotations

import logging
import threading
from collections import defaultdict, deque
from collections.abc import Callable
from typing import Any

import ray

from rollgen.distributed.worker_groups import RayWorkerGroup
from rollgen.errors import RollgenError, WorkerError
from rollgen.rollout import FinishedSample, SampleRequest

logger = logging.getLogger(__name__)

#: Seconds an engine's ``poll`` waits for an ended sample before it answers with none.
POLL_S = 0.5
#: Seconds the polling thread waits for answers before it looks for engines given new samples.
WAIT_S = 0.05


class SampleDispatcher:
    """Spreads streamed samples over a worker group's engines and reports ended ones to
    ``deliver``, a worker's failure to ``failed`` (as a call's failure is reported)."""

    def __init__(
        self,
        group: RayWorkerGroup,
        capacity: list[int],
        deliver: Callable[[list[FinishedSample]], None],
        failed: Callable[[WorkerError], None],
    ) -> None:
        self.group, self.capacity, self.deliver, self.failed = group, list(capacity), deliver, failed
        self._lock = threading.Condition()
        self._queue: deque[SampleRequest] = deque()
        self._where: dict[str, int] = {}
        self._load = [0] * len(capacity)
        self._polls: dict[Any, int] = {}
        self._calls: dict[Any, int] = {}
        self._thread: threading.Thread | None = None
        self._closed = False

    def start(self, requests: list[SampleRequest]) -> None:
        with self._lock:
            self._queue.extend(requests)
            self._send()
            if self._thread is None:
                self._thread = threading.Thread(target=self._poll, daemon=True, name="rollgen-dispatch")
                self._thread.start()
            self._lock.notify_all()

    def abort(self, keys: list[str]) -> None:
        wanted = set(keys)
        by_engine: dict[int, list[str]] = defaultdict(list)
        with self._lock:
            waiting = [r for r in self._queue if r.key in wanted]
            self._queue = deque(r for r in self._queue if r.key not in wanted)
            for key in wanted:
                if key in self._where:
                    by_engine[self._where[key]].append(key)
            for i, engine_keys in by_engine.items():
                self._calls[self.group.workers[i].abort_samples.remote(engine_keys)] = i
        if waiting:
            self.deliver([FinishedSample(r.key, (), (), aborted=True, started=False) for r in waiting])

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join()

    def _send(self) -> None:
        """Hand waiting samples to the engines with room (under the lock)."""
        batches: dict[int, list[SampleRequest]] = defaultdict(list)
        while self._queue:
            room = [c - n for c, n in zip(self.capacity, self._load)]
            engine = max(range(len(room)), key=room.__getitem__)
            if room[engine] <= 0:
                break
            request = self._queue.popleft()
            batches[engine].append(request)
            self._load[engine] += 1
            self._where[request.key] = engine
        for i, requests in batches.items():
            self._calls[self.group.workers[i].start_samples.remote(requests)] = i

    def _poll(self) -> None:
        while True:
            with self._lock:
                busy = {i for i, n in enumerate(self._load) if n}
                for i in busy - set(self._polls.values()):
                    self._polls[self.group.workers[i].poll.remote(POLL_S)] = i
                if not self._polls and not self._calls:
                    self._lock.wait_for(lambda: self._closed or any(self._load) or bool(self._calls))
                if self._closed:
                    return
                refs = list(self._polls) + list(self._calls)
            if not refs:
                continue
            done, _ = ray.wait(refs, num_returns=1, timeout=WAIT_S)
            for ref in done:
                self._answer(ref)

    def _answer(self, ref: Any) -> None:
        with self._lock:
            engine = self._polls.pop(ref, None)
            polled = engine is not None
            if engine is None:
                engine = self._calls.pop(ref)
        name = self.group.names[engine]
        try:
            result = self.group.get([ref], names=[name])[0]
            ended: list[FinishedSample] = result if polled else []
        except RollgenError as exc:  # the engine failed: so did every sample it has
            logger.error("%s failed while streaming samples: %s", name, exc)
            if isinstance(exc, WorkerError):
                self.failed(exc)
            with self._lock:
                self.capacity[engine] = 0
                lost = [k for k, i in self._where.items() if i == engine]
                if not any(self.capacity):  # no engine left for the waiting ones either
                    lost += [r.key for r in self._queue]
                    self._queue.clear()
            ended = [FinishedSample(k, (), (), error=f"{name}: {exc}") for k in lost]
        with self._lock:
            for sample in ended:
                if self._where.pop(sample.key, None) is not None:
                    self._load[engine] -= 1
            self._send()
        if ended:
            self.deliver(ended)
