"""Streamed rollouts. ``BaseGeneration.submit`` hands a batch to the engine and returns a
``Rollout``, which yields each sample's ``SampleResult`` as it finishes (from threads or
asyncio); more batches may be submitted while earlier ones run. ``Streams`` is the core's book of
the samples in flight: it stamps every token with the weight version that produced it and carries
samples through weight updates (``UpdateMode``). Backends only start samples, abort them, and
report each one's tokens when it ends (``FinishedSample``)."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import math
import operator
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from rollgen.data import BatchedDataDict
from rollgen.errors import InputError, OutputError, RollgenError
from rollgen.output import assemble_from_lists
from rollgen.sampling import SampleParams

logger = logging.getLogger(__name__)

#: What a weight update does to samples in flight: ``wait`` for them to finish (new samples wait
#: for the update), ``abort`` them (they end now, ``stop_reason="aborted"``, with the tokens they
#: have), or ``keep`` them (they continue on the new weights: the engine recomputes their prefix
#: under the new weights, and their tokens carry both versions).
UpdateMode = Literal["wait", "abort", "keep"]
UPDATE_MODES: tuple[str, ...] = get_args(UpdateMode)
#: Logged for a report of a sample that is not running: reported twice, or never started.
STRAY_REPORT = "a backend reported sample %r, which is not running (reported twice, or never started)"


@dataclass(frozen=True)
class SampleRequest:
    """One sample as a backend is asked to generate it: ``key`` names it in the backend's
    reports; ``prompt_ids`` is the prompt (after a ``keep`` update: the prompt and the tokens
    generated so far); ``replica``: the data-parallel replica the caller would have it run on
    (``submit(..., replica=)``: one holding its prefix), a preference a backend with several
    replicas honours while that replica has room (None: the least loaded)."""

    key: str
    prompt_ids: tuple[int, ...]
    params: SampleParams
    replica: int | None = None
    #: Whether the caller reads its tokens as they are made (``submit(..., stream_tokens=True)``):
    #: a backend that can reports them as ``SampleProgress`` before the sample's end.
    stream_tokens: bool = False


@dataclass(frozen=True)
class SampleProgress:
    """A backend's report of tokens a running sample made since its last report (only for
    samples started with ``stream_tokens``; optional: the end's report carries every token)."""

    key: str
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]


@dataclass(frozen=True)
class FinishedSample:
    """A backend's report of one sample that ended: its generated tokens and their logprobs;
    ``aborted`` when it ended because it was asked to; ``error`` when the engine failed it;
    ``started`` False when no engine had started it (it waited on the driver for one with room);
    ``replica``: the data-parallel replica it ran on (None: the backend has one engine)."""

    key: str
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    aborted: bool = False
    error: str | None = None
    started: bool = True
    replica: int | None = None
    #: Times it was restarted from its start (or its last ``keep`` point) after an engine died.
    restarts: int = 0


@dataclass(frozen=True)
class InFlightSample:
    """A streamed sample not yet reported (``BaseGeneration.samples_in_flight``): ``key`` is the
    name the backend was started with; ``state`` ``"running"`` (handed to the backend
    ``running_s`` seconds ago, and ``ending`` says why the core asked it to end, if it did) or
    ``"held"`` (waiting for a weight update to end)."""

    rollout_id: int
    index: int
    key: str
    state: Literal["running", "held"]
    running_s: float | None
    ending: str | None

    def __str__(self) -> str:
        where = f"running for {self.running_s:.1f} s" if self.running_s is not None else "held"
        asked = f", asked to end ({self.ending}) but not reported" if self.ending else ", not reported"
        return f"rollout {self.rollout_id} sample {self.index} (key {self.key!r}): {where}{asked}"


@dataclass(frozen=True)
class SampleResult:
    """One sample of a rollout. ``index``: its row in the batch; ``versions``: (weight version,
    index of the first generated token it produced), in order; a sample that ran under one
    version has one segment. ``rollout_id`` and ``tag`` (the caller's ``submit(..., tag=)``)
    name its rollout, so results of several rollouts in one queue can be told apart;
    ``replica`` is the data-parallel replica it last ran on (None: a backend of one engine, or
    it never started). They are left out of ``==``, which compares what was generated."""

    index: int
    token_ids: list[int]
    logprobs: list[float]
    stop_reason: str
    versions: tuple[tuple[int, int], ...]
    rollout_id: int = field(default=-1, compare=False)
    tag: Any = field(default=None, compare=False)
    replica: int | None = field(default=None, compare=False)
    #: Times it was restarted on another engine after the one running it died (``engine_failures:
    #: "replace"``): the tokens of a restarted run are dropped, those kept are the last run's.
    restarts: int = field(default=0, compare=False)

    def version_at(self, position: int) -> int:
        """The weight version that produced generated token ``position``."""
        return [v for v, first in self.versions if first <= position][-1]


@dataclass(frozen=True)
class TokenDelta:
    """New tokens of a sample (``Rollout.events`` of a rollout submitted with
    ``stream_tokens=True``): ``start`` is the position of the first among the sample's generated
    tokens, ``version`` the weight version that made them. A sample's deltas, in order, hold its
    result's tokens; its ``SampleResult`` comes after the last."""

    index: int
    start: int
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    version: int
    rollout_id: int = field(default=-1, compare=False)
    #: Whether they are the sample's last (its result comes next, and may cut its text short:
    #: a stop string they complete).
    final: bool = False


@dataclass
class _Sample:
    rollout: Rollout
    index: int
    prompt_ids: tuple[int, ...]
    params: SampleParams
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[tuple[int, int]] = field(default_factory=list)
    attempt: int = 0
    restarts: int = 0
    #: Why the core asked the backend to abort it (None: it runs to its end).
    ending: Literal["cancelled", "aborted", "continue"] | None = None
    #: The replica the caller prefers, and the one it last ran on.
    prefer: int | None = None
    replica: int | None = None
    #: When it was last handed to the backend (``time.monotonic()``; None: not yet).
    started: float | None = None
    #: The tokens of its current run the backend reported before the run's end (``SampleProgress``).
    progress: list[int] = field(default_factory=list)

    @property
    def key(self) -> str:
        return f"{self.rollout.rollout_id}:{self.index}:{self.attempt}"

    def request(self) -> SampleRequest:
        done = len(self.token_ids)
        params = dataclasses.replace(self.params, max_new_tokens=self.params.max_new_tokens - done)
        return SampleRequest(
            self.key, self.prompt_ids + tuple(self.token_ids), params, self.prefer, self.rollout.stream_tokens
        )

    def delta(self, token_ids: Sequence[int], logprobs: Sequence[float], start: int) -> TokenDelta:
        """Tokens of its current run from ``start`` (a position among all its tokens)."""
        version = self.versions[-1][0]
        return TokenDelta(
            self.index, start, tuple(token_ids), tuple(logprobs), version, self.rollout.rollout_id
        )


@dataclass(frozen=True)
class ReplicaLoad:
    """One data-parallel replica's streamed samples (``gen.replica_load()``): ``running``, sent
    to it and not yet ended; ``capacity``, how many it decodes at once (0: it failed, it gets
    none); ``started``, how many were started on it so far."""

    replica: int
    running: int
    capacity: int
    started: int


class _Feed:
    """One reader's queue of a rollout: what it has not taken yet, and how many results it took
    (it ends after the rollout's last)."""

    def __init__(self) -> None:
        self.ready: deque[Any] = deque()
        self.results_taken = 0


class Rollout:
    """The samples of one submitted batch. Iterate it (``for r in rollout``, or ``async for``)
    to get each ``SampleResult`` once, in the order they finish; ``wait()`` or ``output()`` for
    all of them; ``events()``, of a rollout submitted with ``stream_tokens=True``, for each
    sample's tokens as they are made (``TokenDelta``) and then its result. An engine failure is
    raised from the iteration once the results before it are taken."""

    _ids = itertools.count()

    def __init__(
        self,
        streams: Streams,
        batch: BatchedDataDict[Any],
        pad_token_id: int,
        tag: Any = None,
        stream_tokens: bool = False,
    ) -> None:
        #: Unique among this process's rollouts; every result carries it, and ``tag``.
        self.rollout_id = next(self._ids)
        self.tag = tag
        self.size = int(batch.size)
        self.stream_tokens = stream_tokens
        self._streams = streams
        self._batch = batch
        self._pad = pad_token_id
        self._cond = threading.Condition()
        self._results_feed = _Feed()
        self._events_feed = _Feed() if stream_tokens else None
        self._results: dict[int, SampleResult] = {}
        self._error: BaseException | None = None
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []

    # ---- what the core calls ------------------------------------------------------------------
    # ``wakes``: the caller wakes this rollout's asyncio readers with those of others it
    # reported to at once (``Wakes.send``), one call into each event loop
    def _put(self, result: SampleResult, wakes: Wakes | None = None) -> None:
        with self._cond:
            self._results[result.index] = result
            self._results_feed.ready.append(result)
            if self._events_feed is not None:
                self._events_feed.ready.append(result)
            self._wake(wakes)

    def _put_delta(self, delta: TokenDelta, wakes: Wakes | None = None) -> None:
        if self._events_feed is None:
            return
        with self._cond:
            self._events_feed.ready.append(delta)
            self._wake(wakes)

    def _fail(self, error: BaseException, wakes: Wakes | None = None) -> None:
        with self._cond:
            self._error = self._error or error
            self._wake(wakes)

    def _wake(self, wakes: Wakes | None) -> None:
        self._cond.notify_all()
        if self._waiters:
            own = wakes if wakes is not None else Wakes()
            own.add(self._waiters)
            self._waiters.clear()
            if wakes is None:
                own.send()

    # ---- the trainer's side -------------------------------------------------------------------
    @property
    def done(self) -> bool:
        """Whether every sample has finished (or the rollout failed)."""
        with self._cond:
            return len(self._results) == self.size or self._error is not None

    def in_flight(self) -> list[InFlightSample]:
        """This rollout's samples not yet reported (``BaseGeneration.samples_in_flight``)."""
        return [s for s in self._streams.samples() if s.rollout_id == self.rollout_id]

    def cancel(self, indices: int | Sequence[int] | None = None) -> None:
        """End the samples ``indices`` (None: all of them) that have not finished: each is
        yielded with ``stop_reason="cancelled"`` and the tokens it has."""
        if indices is None:
            wanted = list(range(self.size))
        else:
            items: Sequence[Any] = (
                indices
                if isinstance(indices, Sequence) and not isinstance(indices, (str, bytes))
                else [indices]
            )
            try:
                wanted = [_index(i) for i in items]
            except TypeError:
                raise InputError(
                    f"cancel takes a sample index (an int), a sequence of them, or None; got {indices!r}"
                ) from None
        bad = [i for i in wanted if not 0 <= i < self.size]
        if bad:
            raise InputError(f"cancel: sample indices {bad} are not in this rollout of {self.size}", bad)
        self._streams.cancel(self, list(wanted))

    def _next(self, feed: _Feed, block: bool) -> Any:
        """The next item of ``feed``; None at the end, or (``block`` False) when none is ready
        (under the lock, or taking it)."""
        with self._cond:
            while True:
                if feed.ready:
                    item = feed.ready.popleft()
                    if isinstance(item, SampleResult):
                        feed.results_taken += 1
                    return item
                if self._error is not None:
                    raise self._error
                if feed.results_taken == self.size or not block:
                    return None
                self._cond.wait()

    def _iterate(self, feed: _Feed) -> Iterator[Any]:
        while (item := self._next(feed, block=True)) is not None:
            yield item

    async def _aiterate(self, feed: _Feed) -> AsyncIterator[Any]:
        async for batch in self._abatches(feed):
            for item in batch:
                yield item

    async def _abatches(self, feed: _Feed) -> AsyncIterator[list[Any]]:
        """Every item of ``feed`` ready at once, as one list, waiting for the next otherwise."""
        loop = asyncio.get_running_loop()
        while True:
            with self._cond:
                batch = []
                while feed.ready:  # the error, if any, once these are taken
                    batch.append(self._next(feed, block=False))
                if not batch and self._next(feed, block=False) is None and feed.results_taken == self.size:
                    return
                future: asyncio.Future[None] | None = None
                if not batch:
                    future = loop.create_future()
                    self._waiters.append((loop, future))
            if batch:
                yield batch
            elif future is not None:
                try:
                    await future
                finally:  # a cancelled wait leaves no waiter behind
                    with self._cond:
                        if (loop, future) in self._waiters:
                            self._waiters.remove((loop, future))

    def __iter__(self) -> Iterator[SampleResult]:
        return self._iterate(self._results_feed)

    def __aiter__(self) -> AsyncIterator[SampleResult]:
        return self._aiterate(self._results_feed)

    def result_batches(self) -> AsyncIterator[list[SampleResult]]:
        """The results as ``async for`` gives them, in lists of those ready at once."""
        return self._abatches(self._results_feed)

    def events(self) -> Events:
        """Each sample's new tokens as the engine makes them (``TokenDelta``), then its
        ``SampleResult``, from threads (``for``) or asyncio (``async for``); a reader of its own,
        beside the results' iteration. InputError unless submitted with ``stream_tokens=True``.
        A backend that reports no tokens before a sample's end gives one delta then."""
        if self._events_feed is None:
            raise InputError("Rollout.events() needs a rollout submitted with stream_tokens=True")
        return Events(self, self._events_feed)

    def groups(self, k: int) -> Groups:
        """The results in groups of ``k`` consecutive rows (rows ``g*k`` to ``g*k + k - 1``: the
        ``k`` samples of one prompt in a GRPO batch), iterated from threads or asyncio: each
        group once all its samples finished, in the order groups complete, its results in row
        order. It takes the results as iterating the rollout does. InputError unless ``k``
        divides the rollout's size."""
        if isinstance(k, bool) or not isinstance(k, int) or k < 1 or self.size % k:
            raise InputError(f"groups({k!r}): a group size must be a positive int dividing {self.size}")
        return Groups(self, k)

    def wait(self) -> list[SampleResult]:
        """Every sample's result, in batch order (waits for them; results already taken from the
        iteration are included)."""
        for _ in self:
            pass
        with self._cond:
            return [self._results[i] for i in range(self.size)]

    def output(self) -> BatchedDataDict[Any]:
        """All results in ``generate``'s layout (GenerationOutputSpec with ``stop_reasons``),
        plus ``weight_versions``: each sample's version segments."""
        results = self.wait()
        out = assemble_from_lists(
            self._batch["input_ids"],
            self._batch["input_lengths"],
            [r.token_ids for r in results],
            [r.logprobs for r in results],
            self._pad,
        )
        out["stop_reasons"] = [r.stop_reason for r in results]
        out["weight_versions"] = [r.versions for r in results]
        return out


class Events:
    """``Rollout.events()``: ``TokenDelta`` and ``SampleResult`` items, in the order made."""

    def __init__(self, rollout: Rollout, feed: _Feed) -> None:
        self._rollout, self._feed = rollout, feed

    def __iter__(self) -> Iterator[TokenDelta | SampleResult]:
        return self._rollout._iterate(self._feed)

    def __aiter__(self) -> AsyncIterator[TokenDelta | SampleResult]:
        return self._rollout._aiterate(self._feed)

    def batches(self) -> AsyncIterator[list[TokenDelta | SampleResult]]:
        """From asyncio: every item ready at once, as one list (a server writes them together)."""
        return self._rollout._abatches(self._feed)


class Groups:
    """``Rollout.groups(k)``: whole groups of ``k`` rows, as each completes."""

    def __init__(self, rollout: Rollout, k: int) -> None:
        self._rollout, self._k = rollout, k
        self._pending: dict[int, dict[int, SampleResult]] = {}

    def _add(self, result: SampleResult) -> list[SampleResult] | None:
        """The group ``result`` completes, in row order; None while it has rows to come."""
        group = self._pending.setdefault(result.index // self._k, {})
        group[result.index] = result
        if len(group) < self._k:
            return None
        del self._pending[result.index // self._k]
        return [group[i] for i in sorted(group)]

    def __iter__(self) -> Iterator[list[SampleResult]]:
        for result in self._rollout:
            if (group := self._add(result)) is not None:
                yield group

    async def __aiter__(self) -> AsyncIterator[list[SampleResult]]:
        async for result in self._rollout:
            if (group := self._add(result)) is not None:
                yield group


def _index(value: Any) -> int:
    """``value`` as a sample index: an int (numpy's and 0-d tensors' too), not a bool."""
    if isinstance(value, bool):
        raise TypeError(value)
    return operator.index(value)


def _resolve(futures: list[asyncio.Future[None]]) -> None:
    for future in futures:
        if not future.done():
            future.set_result(None)


class Wakes:
    """Asyncio readers to wake (their waiting futures), by event loop: ``send`` makes one call
    into each loop for all of its readers, however many rollouts a report reached."""

    def __init__(self) -> None:
        self._futures: dict[asyncio.AbstractEventLoop, list[asyncio.Future[None]]] = {}

    def add(self, waiters: Iterable[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]]) -> None:
        for loop, future in waiters:
            self._futures.setdefault(loop, []).append(future)

    def send(self) -> None:
        for loop, futures in self._futures.items():
            try:
                loop.call_soon_threadsafe(_resolve, futures)
            except RuntimeError:  # its loop closed while they waited: nobody is waiting there now
                logger.debug("an event loop closed while %d readers waited on it", len(futures))
        self._futures.clear()


class Streams:
    """The core's book of streamed samples, between the trainer's calls and a backend's
    ``start(requests)`` / ``abort(keys)`` hooks; backends report ended samples to ``deliver``
    (from any thread). ``stop_reason(params, end, tokens)`` names why a sample that ran to its
    end stopped (``end``: its prompt plus generated tokens). As ``generate``'s output is, each
    report is checked: logprobs that do not match its tokens fail that sample's rollout with an
    ``OutputError``; a NaN or infinite logprob calls ``nonfinite()`` (the engine's KV cache may
    hold NaNs from the weights that produced it)."""

    def __init__(
        self,
        start: Callable[[list[SampleRequest]], None],
        abort: Callable[[list[str]], None],
        stop_reason: Callable[[SampleParams, int, list[int]], str],
        nonfinite: Callable[[], None] = lambda: None,
    ) -> None:
        self._start, self._abort, self._stop_reason = start, abort, stop_reason
        self._nonfinite = nonfinite
        self._cond = threading.Condition()
        self._running: dict[str, _Sample] = {}
        #: Samples waiting for an update to end before they start (or continue).
        self._held: list[_Sample] = []
        self._updating = False
        #: How many weight updates completed: the version new tokens are made with.
        self.version = 0
        #: The adapter version samples start (or continue) with (None: the model alone).
        self.adapter: int | None = None

    @property
    def in_flight(self) -> int:
        """Samples started or waiting to start, not yet finished."""
        with self._cond:
            return len(self._running) + len(self._held)

    def samples(self) -> list[InFlightSample]:
        """Every sample in flight: running ones (longest running first), then held ones."""
        now = time.monotonic()
        with self._cond:
            running = sorted(self._running.values(), key=lambda s: s.started or now)
            return [
                InFlightSample(
                    s.rollout.rollout_id, s.index, s.key, "running", now - (s.started or now), s.ending
                )
                for s in running
            ] + [
                InFlightSample(s.rollout.rollout_id, s.index, s.key, "held", None, s.ending)
                for s in self._held
            ]

    def submit(
        self,
        rollout: Rollout,
        prompts: list[tuple[int, ...]],
        params: Sequence[SampleParams],
        replica: int | None = None,
    ) -> None:
        samples = [
            _Sample(rollout, i, p, sp, prefer=replica)
            for i, (p, sp) in enumerate(zip(prompts, params, strict=True))
        ]
        with self._cond:
            if self._updating:
                self._held.extend(samples)
                return
            self._launch(samples)

    def _launch(self, samples: list[_Sample]) -> None:
        """Start ``samples`` (under the lock), each stamped with the current version."""
        if not samples:
            return
        for s in samples:
            if s.versions and s.versions[-1][1] == len(s.token_ids):  # it made no token under that one
                s.versions.pop()
            if not s.versions or s.versions[-1][0] != self.version:
                s.versions.append((self.version, len(s.token_ids)))
            if s.params.adapter != self.adapter or s.params.weight_version != self.version:
                s.params = dataclasses.replace(s.params, adapter=self.adapter, weight_version=self.version)
            s.started = time.monotonic()
            s.progress = []
            self._running[s.key] = s
        try:
            self._start([s.request() for s in samples])
        except BaseException as exc:
            for s in samples:
                self._running.pop(s.key, None)
                s.rollout._fail(exc)
            raise

    def adapters_in_use(self) -> set[int]:
        """The adapter versions running samples decode with."""
        with self._cond:
            return {a for s in self._running.values() if (a := s.params.adapter) is not None}

    def cancel(self, rollout: Rollout, indices: list[int]) -> None:
        wanted = set(indices)
        with self._cond:
            held = [s for s in self._held if s.rollout is rollout and s.index in wanted]
            for s in held:
                self._held.remove(s)
                self._finish(s, "cancelled")
            running = [s for s in self._running.values() if s.rollout is rollout and s.index in wanted]
            for s in running:
                s.ending = "cancelled"
        if running:
            self._abort([s.key for s in running])

    def progress(self, reports: Iterable[SampleProgress]) -> None:
        """A backend's report of tokens that running samples made (keys they were started
        with); reports of samples no longer running are dropped (they ended meanwhile)."""
        wakes = Wakes()
        with self._cond:
            for report in reports:
                sample = self._running.get(report.key)
                if sample is None or not report.token_ids:
                    continue
                if len(report.token_ids) != len(report.logprobs):
                    logger.error(
                        "sample %s: a progress report of %d tokens and %d logprobs is dropped",
                        report.key,
                        len(report.token_ids),
                        len(report.logprobs),
                    )
                    continue
                start = len(sample.token_ids) + len(sample.progress)
                sample.progress.extend(report.token_ids)
                sample.rollout._put_delta(sample.delta(report.token_ids, report.logprobs, start), wakes)
        wakes.send()

    def deliver(self, finished: Iterable[FinishedSample]) -> None:
        """A backend's report of samples that ended (keys it was started with)."""
        wakes = Wakes()
        with self._cond:
            for f in finished:
                sample = self._running.pop(f.key, None)
                if sample is None:
                    logger.error(STRAY_REPORT, f.key)
                    continue
                try:
                    self._ended(sample, f, wakes)
                except Exception as exc:  # noqa: BLE001 - this sample's rollout raises it; the others go on
                    logger.exception("sample %s: its end could not be recorded", f.key)
                    sample.rollout._fail(exc, wakes)
            self._cond.notify_all()
        wakes.send()

    def _ended(self, sample: _Sample, f: FinishedSample, wakes: Wakes) -> None:
        if f.error is None and len(f.token_ids) != len(f.logprobs):
            raise OutputError(
                f"sample {sample.index}: the engine returned {len(f.logprobs)} logprobs for "
                f"{len(f.token_ids)} tokens"
            )
        if not all(map(math.isfinite, f.logprobs)):
            self._nonfinite()
        shown = len(sample.progress)
        if f.error is None and tuple(f.token_ids[:shown]) != tuple(sample.progress):
            raise OutputError(
                f"sample {sample.index}: the engine's report of its end does not start with the "
                f"{shown} tokens it reported while it ran"
            )
        rest = sample.delta(f.token_ids[shown:], f.logprobs[shown:], len(sample.token_ids) + shown)
        sample.restarts += f.restarts
        sample.token_ids.extend(f.token_ids)
        sample.logprobs.extend(f.logprobs)
        if f.started and f.replica is not None:
            sample.replica = f.replica
        tokens, params = sample.token_ids, sample.params
        # a sample that reached its end as it was stopped has nothing left to continue
        complete = len(tokens) >= params.max_new_tokens or bool(
            tokens and tokens[-1] in params.stop_token_ids
        )
        if f.error is not None:
            sample.rollout._fail(
                RollgenError(f"sample {sample.index} failed in the engine: {f.error}"), wakes
            )
        elif not f.aborted or sample.ending is None or (complete and sample.ending == "continue"):
            end = len(sample.prompt_ids) + len(tokens)
            self._finish(sample, self._stop_reason(params, end, tokens), rest, wakes)
        elif sample.ending == "continue" or (
            sample.ending == "aborted" and self._updating and not (f.started and tokens)
        ):
            # an update's abort ends the samples that made tokens; one with none yet loses
            # nothing by starting again after it, on the new weights
            if rest.token_ids:
                sample.rollout._put_delta(rest, wakes)
            sample.attempt += 1
            self._held.append(sample)
        else:
            self._finish(sample, sample.ending, rest, wakes)

    def _finish(
        self, sample: _Sample, reason: str, rest: TokenDelta | None = None, wakes: Wakes | None = None
    ) -> None:
        """``sample``'s result, after ``rest`` (its last tokens, not shown yet) if any."""
        # a sample that never started is stamped with the version it would have run under
        versions = tuple(sample.versions) or ((self.version, 0),)
        rollout = sample.rollout
        if rest is not None and rest.token_ids:
            rollout._put_delta(dataclasses.replace(rest, final=True), wakes)
        rollout._put(
            SampleResult(
                sample.index,
                sample.token_ids,
                sample.logprobs,
                reason,
                versions,
                rollout.rollout_id,
                rollout.tag,
                sample.replica,
                sample.restarts,
            ),
            wakes,
        )

    @contextmanager
    def update(self, mode: UpdateMode, fresh: Callable[[], bool], interrupt: bool = True) -> Iterator[None]:
        """Around a weight update: first deal with the samples in flight as ``mode`` says
        (waiting for the engine to end them), then apply the update in the body, then start the
        held samples (``keep``: continuing under the new version). An update that fails leaves
        the version as it was; where it left the engine stale (``fresh()`` False), the samples
        held for it end ``aborted`` (with the tokens they have). Without ``interrupt`` (a
        ``keep`` update of an adapter: the old version stays in the engine) running samples go
        on untouched under theirs; new ones wait for the update."""
        if mode not in UPDATE_MODES:
            raise InputError(f"update mode {mode!r}: use one of {list(UPDATE_MODES)}")
        with self._cond:
            self._updating = True
            running = list(self._running.values()) if interrupt else []
            if mode != "wait":
                for s in running:
                    s.ending = s.ending or ("aborted" if mode == "abort" else "continue")
        try:
            if running and mode != "wait":
                self._abort([s.key for s in running])
            with self._cond:
                self._cond.wait_for(lambda: not (interrupt and self._running))
            yield
            with self._cond:
                self.version += 1
        finally:
            with self._cond:
                self._updating = False
                held, self._held = self._held, []
                if not fresh():  # nothing runs on mixed weights
                    for s in held:
                        self._finish(s, "aborted")
                    held = []
                for s in held:
                    s.ending = None
                self._launch(held)

    def close(self, timeout_s: float) -> None:
        """End every sample (at shutdown): held ones at once, running ones once the engine
        reports them (or fails them after ``timeout_s``, each named), all ``aborted``."""
        with self._cond:
            for s in self._held:
                self._finish(s, "aborted")
            self._held = []
            running = list(self._running.values())
            for s in running:
                s.ending = "aborted"
        if running:
            self._abort([s.key for s in running])
            with self._cond:
                if not self._cond.wait_for(lambda: not self._running, timeout_s):
                    for s in self._running.values():
                        s.rollout._fail(
                            RollgenError(
                                f"sample {s.index} of rollout {s.rollout.rollout_id} (key {s.key!r}): the "
                                f"engine shut down without reporting it within {timeout_s:g} s (a backend "
                                "must report every sample it started once, aborted ones too)"
                            )
                        )
                    self._running.clear()
