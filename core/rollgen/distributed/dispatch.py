"""``SampleDispatcher``: the driver's side of streamed samples on engines in Ray actors. A sample
goes to the replica its request prefers (``SampleRequest.replica``: one that holds its prefix)
while that one has room, else to the engine with the most free room (``EngineWorker._capacity``
each); samples wait on the driver when every engine is full, and go out as engines free up; a
thread polls the engines that have samples and hands the new tokens of samples that stream them
and what ended to the core (each stamped with the replica it ran on), and an engine's failure to
the generation. ``start`` only queues: a sending thread hands what queued meanwhile to each engine
in one call, so a burst of submits (a server's requests) reaches an engine in few calls. A
sample restarted after its engine died continues from the tokens already handed on (those of a
sample that streams them), so nothing handed on is taken back. Which engines take samples, and
with what capacity, is the replicas' (``rollgen.distributed.replicas``); the dispatcher listens
for one that leaves service (its samples go to the others) or returns. An engine that makes no
token for ``call_timeout_s`` while it has samples is killed as wedged: its death, as any other."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable, Iterable
from typing import Any

import ray

from rollgen.distributed.replicas import Replicas
from rollgen.errors import OutputError, RollgenError, WorkerError
from rollgen.rollout import FinishedSample, ReplicaLoad, SampleProgress, SampleRequest

logger = logging.getLogger(__name__)

#: Seconds an engine's ``poll`` waits for an ended sample before it answers with none.
POLL_S = 0.5
#: Seconds the polling thread waits for answers before it looks for engines given new samples.
WAIT_S = 0.05


class SampleDispatcher:
    """Spreads streamed samples over the engines of ``replicas`` in service and reports ended
    ones to ``deliver``, a worker's failure to ``failed`` (as a call's failure is reported)."""

    def __init__(
        self,
        replicas: Replicas,
        deliver: Callable[[list[FinishedSample]], None],
        failed: Callable[[WorkerError], None],
        progress: Callable[[list[SampleProgress]], None] = lambda reports: None,
    ) -> None:
        self.replicas, self.group = replicas, replicas.group
        self.deliver, self.failed, self.progress = deliver, failed, progress
        #: The samples on engines, and how often each was restarted after its engine died.
        self._requests: dict[str, SampleRequest] = {}
        self._restarts: dict[str, int] = defaultdict(int)
        #: Of samples that stream their tokens: the tokens handed on, and how many of them runs
        #: before the current one made (the current run's prompt ends with those).
        self._made: dict[str, tuple[list[int], list[float]]] = {}
        self._carried: dict[str, int] = {}
        self._lock = threading.Condition()
        self._queue: deque[SampleRequest] = deque()
        self._where: dict[str, int] = {}
        self._load = [0] * len(replicas)
        self._started = [0] * len(replicas)
        self._polls: dict[Any, int] = {}
        self._calls: dict[Any, int] = {}
        #: Each engine's count of tokens made (its polls say), and for how long this thread has
        #: listened while it had samples and made none; when this thread last counted.
        self._tokens = [0] * len(replicas)
        self._quiet = [0.0] * len(replicas)
        self._counted = time.monotonic()
        #: Samples ``start`` took and the sending thread has not yet queued (its own lock, so
        #: that a start never waits for a call to an engine).
        self._inbox: list[SampleRequest] = []
        self._inbox_ready = threading.Condition(threading.Lock())
        #: The ends of samples whose call Ray refused, for the sending thread to deliver (outside
        #: every lock: ``_send`` runs under the replicas' lock too, as their listener).
        self._unsent: list[FinishedSample] = []
        self._threads: list[threading.Thread] = []
        self._closed = False
        replicas.listen(self)

    def start(self, requests: list[SampleRequest]) -> None:
        """Queue ``requests``; the sending thread hands them on, with those queued meanwhile."""
        with self._inbox_ready:
            if not self._threads:
                self._threads = [
                    threading.Thread(target=run, daemon=True, name=f"rollgen-dispatch-{what}")
                    for run, what in ((self._poll, "poll"), (self._sender, "send"))
                ]
                for thread in self._threads:
                    thread.start()
            self._inbox.extend(requests)
            self._inbox_ready.notify()

    def abort(self, keys: list[str]) -> None:
        wanted = set(keys)
        by_engine: dict[int, list[str]] = defaultdict(list)
        with self._lock:
            self._queue.extend(self._take_inbox())
            waiting = [r for r in self._queue if r.key in wanted]
            self._queue = deque(r for r in self._queue if r.key not in wanted)
            gone = [self._end_of(FinishedSample(r.key, (), (), aborted=True, started=False)) for r in waiting]
            for key in wanted:
                if key in self._where:
                    by_engine[self._where[key]].append(key)
            for i, engine_keys in by_engine.items():
                self._calls[self.group.workers[i].abort_samples.remote(engine_keys)] = i
            self._send()  # the others ``start`` queued with them
            self._lock.notify_all()  # the polling thread: calls to answer, engines with samples
        if gone:
            self.deliver(gone)

    def load(self) -> list[ReplicaLoad]:
        """Each engine's samples now, in one consistent snapshot."""
        with self._lock:
            return [
                ReplicaLoad(i, running, self.capacity(i) if self.replicas.in_service(i) else 0, started)
                for i, (running, started) in enumerate(zip(self._load, self._started))
            ]

    def capacity(self, engine: int) -> int:
        """How many samples ``engine`` decodes at once (what it reported once started)."""
        return int(self.replicas.info(engine)["capacity"])

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._lock.notify_all()
        with self._inbox_ready:
            self._inbox_ready.notify_all()
        for thread in self._threads:
            thread.join()

    def _take_inbox(self) -> list[SampleRequest]:
        with self._inbox_ready:
            taken, self._inbox = self._inbox, []
        return taken

    def _sender(self) -> None:
        """Hand what ``start`` queued to the engines, all that queued meanwhile in one go, and
        deliver the ends of samples whose call Ray refused."""
        while True:
            with self._inbox_ready:
                self._inbox_ready.wait_for(lambda: self._closed or bool(self._inbox or self._unsent))
            with self._lock:
                if self._closed:
                    return
                self._send()
                unsent, self._unsent = self._unsent, []
                self._lock.notify_all()  # the polling thread: engines have samples
            if unsent:
                self.deliver(unsent)

    def _send(self) -> None:
        """Hand waiting samples (and those ``start`` queued) to the engines with room (under
        the lock); the ends of those whose call Ray refused, or of all waiting ones if placing
        them failed, go to the sending thread to deliver."""
        self._queue.extend(self._take_inbox())
        try:
            while self._queue and self._send_round():
                pass  # a refused call freed its engine's room: place the rest again
        except Exception as exc:  # noqa: BLE001 - a fault here fails the waiting samples, not the caller's thread
            logger.exception("streamed samples could not be handed to the engines")
            self._not_sent(self._queue, f"not sent: {exc}")
            self._queue.clear()
        if self._unsent:
            with self._inbox_ready:
                self._inbox_ready.notify()

    def _send_round(self) -> bool:
        """Place waiting samples on the engines with room and call each engine once (under the
        lock); True when Ray refused a call (its samples' ends are in ``_unsent``)."""
        batches: dict[int, list[SampleRequest]] = defaultdict(list)
        while self._queue:
            room = [
                self.capacity(i) - n if self.replicas.in_service(i) else 0 for i, n in enumerate(self._load)
            ]
            engine = place(self._queue[0].replica, room)
            if engine is None:
                break
            request = self._queue.popleft()
            batches[engine].append(request)
            self._load[engine] += 1
            self._started[engine] += 1
            self._where[request.key] = engine
            self._requests[request.key] = request
        refused = False
        for i, requests in batches.items():
            try:
                self._calls[self.group.workers[i].start_samples.remote(requests)] = i
            except Exception as exc:  # noqa: BLE001 - Ray refused the call: its samples fail, not the thread
                logger.error("%s: samples could not be sent: %s", self.group.names[i], exc)
                for r in requests:
                    del self._where[r.key]
                    self._load[i] -= 1
                    self._started[i] -= 1
                self._not_sent(requests, f"{self.group.names[i]}: samples could not be sent to it: {exc}")
                refused = True
        return refused

    def _not_sent(self, requests: Iterable[SampleRequest], error: str) -> None:
        """The ends of ``requests``, never started, failed with ``error``, for the sending thread
        to deliver (under the lock)."""
        self._unsent += [
            self._end_of(FinishedSample(r.key, (), (), error=error, started=False)) for r in requests
        ]

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
            done, rest = ray.wait(refs, num_returns=1, timeout=WAIT_S)
            if done and rest:  # every answer that is in, before any engine is judged silent
                done += ray.wait(rest, num_returns=len(rest), timeout=0)[0]
            for ref in done:
                self._answer(ref)
            self._kill_wedged(time.monotonic())

    def _kill_wedged(self, now: float) -> None:
        """Kill each engine that has had samples and made no token for ``call_timeout_s`` of
        this thread's listening (up to ``now``): it fails as dead (its samples go elsewhere
        where the generation replaces). Time this thread spent elsewhere (waiting for the
        core's lock, say) counts as at most ``POLL_S``: engines' answers waited meanwhile."""
        limit = self.group.call_timeout_s
        with self._lock:
            listened, self._counted = min(now - self._counted, POLL_S), now
            for i, running in enumerate(self._load):
                self._quiet[i] = self._quiet[i] + listened if running else 0.0
            wedged = [i for i, quiet in enumerate(self._quiet) if limit is not None and quiet > limit]
            for i in wedged:  # its answers still to come are not read
                self._quiet[i] = 0.0
                self._forget_calls(i)
        for i in wedged:
            name = self.group.names[i]
            why = f"made no token for call_timeout_s={limit} s while it had samples"
            self._died(i, name, self.group.kill_wedged({name}, why))

    def _forget_calls(self, engine: int) -> None:
        """Drop the calls to ``engine`` not yet answered (under the lock): their answers are
        not read."""
        for refs in (self._polls, self._calls):
            for ref in [r for r, e in refs.items() if e == engine]:
                del refs[ref]

    def _died(self, engine: int, name: str, exc: WorkerError) -> None:
        """Engine ``engine`` died (``exc``): its samples run again on the others where the
        generation outlives it, else they fail. A failure of that handling is logged: this
        thread goes on, so the other engines' samples still end."""
        try:
            if not self.replicas.died(engine, exc):
                self._failed(engine, name, exc)
        except Exception:  # noqa: BLE001 - logged; the polling thread must not end
            logger.exception("%s: its death could not be handled", name)

    def _answer(self, ref: Any) -> None:
        with self._lock:
            engine = self._polls.pop(ref, None)
            polled = engine is not None
            if engine is None:
                engine = self._calls.pop(ref, None)
            if engine is None:  # a call to an engine since replaced (``reopen``)
                return
        name = self.group.names[engine]
        moved: list[SampleProgress] = []
        ended: list[FinishedSample] = []
        try:
            if polled:
                packed, ended, tokens = self.group.get([ref], names=[name])[0]
                moved = packed.unpack()
                self._heard(engine, tokens)
            else:
                self.group.get([ref], names=[name])
        except RollgenError as exc:  # a death the generation outlives re-runs its samples elsewhere
            if isinstance(exc, WorkerError) and exc.died:
                self._died(engine, name, exc)
            else:
                self._failed(engine, name, exc)
            return
        except Exception as exc:  # noqa: BLE001 - an answer that cannot be read fails its engine, not this thread
            error = OutputError(f"its answer could not be read ({exc!r}); it is out of service")
            self._failed(engine, name, error)
            return
        self._moved(engine, moved)
        self._ended(engine, [dataclasses.replace(f, replica=engine) for f in ended])

    def _heard(self, engine: int, tokens: int) -> None:
        """Engine ``engine`` has made ``tokens`` tokens so far: if more than before, it is not
        stuck."""
        with self._lock:
            if tokens != self._tokens[engine]:
                self._tokens[engine] = tokens
                self._quiet[engine] = 0.0

    def _moved(self, engine: int, moved: list[SampleProgress]) -> None:
        """Hand on the new tokens of streaming samples (kept, so that a restart continues them)."""
        with self._lock:
            moved = [m for m in moved if self._where.get(m.key) == engine]  # not of one taken out since
            for m in moved:
                tokens, logprobs = self._made.setdefault(m.key, ([], []))
                tokens.extend(m.token_ids)
                logprobs.extend(m.logprobs)
        if moved:
            self.progress(moved)

    def _end_of(self, sample: FinishedSample) -> FinishedSample:
        """``sample``'s report with the tokens of its earlier runs first, its restarts counted
        (under the lock; forgets the sample)."""
        self._requests.pop(sample.key, None)
        restarts = self._restarts.pop(sample.key, 0)
        made = self._made.pop(sample.key, None)
        carried = self._carried.pop(sample.key, 0)
        if made is not None and carried and sample.error is None:
            tokens, logprobs = made[0][:carried], made[1][:carried]
            sample = dataclasses.replace(
                sample,
                token_ids=(*tokens, *sample.token_ids),
                logprobs=(*logprobs, *sample.logprobs),
                started=True,
            )
        return dataclasses.replace(sample, restarts=restarts)

    def _failed(self, engine: int, name: str, exc: RollgenError) -> None:
        """Engine ``engine`` failed: so did every sample it has; it takes no more."""
        logger.error("%s failed while streaming samples: %s", name, exc)
        if isinstance(exc, WorkerError):
            self.failed(exc)
        with self._lock:
            lost = [k for k, i in self._where.items() if i == engine]
            for key in lost:
                del self._where[key]
            self._load[engine] -= len(lost)
        self.replicas.take_out(engine, exc)
        with self._lock:
            if not self.replicas.live:  # no engine left for the waiting ones either
                lost += [r.key for r in self._queue] + [r.key for r in self._take_inbox()]
                self._queue.clear()
            ended = [self._end_of(FinishedSample(k, (), (), error=f"{name}: {exc}")) for k in lost]
            self._send()
        if ended:
            self.deliver(ended)

    def _ended(self, engine: int, ended: list[FinishedSample]) -> None:
        """Report the samples ``ended`` of ``engine`` (each with its restarts) and send more; a
        report of a sample no longer on ``engine`` (taken out and sent elsewhere meanwhile, or
        failed) is dropped."""
        with self._lock:
            ended = [s for s in ended if self._where.get(s.key) == engine]
            for sample in ended:
                del self._where[sample.key]
                self._load[engine] -= 1
            ended = [self._end_of(s) for s in ended]
            self._send()
        if ended:
            self.deliver(ended)

    # ---- replicas leaving and returning (``ReplicaListener``) -----------------------------------
    def replica_left(self, engine: int) -> None:
        """Engine ``engine`` is out of service: its samples go back to the head of the queue
        (from their start, with the same settings and seed; one that streams its tokens from
        the last it handed on), for the other engines; calls to it are forgotten."""
        with self._lock:
            self._forget_calls(engine)
            keys = [k for k, i in self._where.items() if i == engine]
            for key in keys:
                del self._where[key]
                self._restarts[key] += 1
            self._load[engine] = 0
            self._queue.extendleft(reversed([self._continued(self._requests.pop(k)) for k in keys]))
            if keys:
                logger.warning(
                    "%s: %d streamed sample(s) restart on other engines", self.group.names[engine], len(keys)
                )
            self._send()
            self._lock.notify_all()

    def _continued(self, request: SampleRequest) -> SampleRequest:
        """``request`` to run again after its engine died: its prompt extended by the tokens its
        run handed on, its budget less them (under the lock)."""
        made = self._made.get(request.key)
        carried = self._carried.get(request.key, 0)
        if made is None or len(made[0]) == carried:
            return request
        new = tuple(made[0][carried:])
        self._carried[request.key] = len(made[0])
        params = dataclasses.replace(request.params, max_new_tokens=request.params.max_new_tokens - len(new))
        return dataclasses.replace(request, prompt_ids=request.prompt_ids + new, params=params)

    def replica_returned(self, engine: int) -> None:
        """Engine ``engine`` (a new actor) is in service again: the waiting samples may go to it."""
        with self._lock:
            self._send()
            self._lock.notify_all()


def place(preferred: int | None, room: list[int]) -> int | None:
    """The engine a sample goes to: ``preferred`` while it has room, else the one with the most
    room (the first of equals); None while none has room."""
    if preferred is not None and 0 <= preferred < len(room) and room[preferred] > 0:
        return preferred
    engine = max(range(len(room)), key=room.__getitem__)
    return engine if room[engine] > 0 else None
