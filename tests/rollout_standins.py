"""Stand-ins for the streamed-rollout tests (``test_rollout*.py``), not engines: ``Recorder`` records
every start and abort the core asks for and lets the test report each sample's end when it
chooses; ``StandInBackend`` wires one to a ``Streams``; ``PlainGeneration``/``StandInGeneration``
are ``BaseGeneration`` on the tiny model's config. Threads are ordered with Events and
Conditions; a join with a timeout is only ever a safety net."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from rollgen import Backend, BaseGeneration, BatchedDataDict, Capability, GenerationConfig
from rollgen.data import right_pad
from rollgen.output import assemble_from_lists, stop_reason
from rollgen.refit import EngineFacts, InProcessLink, Named
from rollgen.rollout import (
    FinishedSample,
    Rollout,
    SampleProgress,
    SampleRequest,
    SampleResult,
    Streams,
    UpdateMode,
)
from rollgen.sampling import SampleParams
from tests.waiting import SAFETY_S

#: Token ids of the stand-in backend's made-up vocabulary (``Streams`` tests).
PAD, EOS, STOP = 0, 2, 3


MAX_MODEL_LEN = 64


#: How long a thread may take to reach a point the test waits for before the test fails (never
#: a delay the outcome depends on): the project's one bound.
DEADLINE_S = SAFETY_S


# ---- stand-ins ------------------------------------------------------------------------------------
class Recorder:
    """A stand-in for a backend's streaming engine, not an engine: it records every
    ``start(requests)`` and ``abort(keys)`` the core asks for, never ends a sample by itself, and
    lets the test report a sample's end (``finish``) at the moment it chooses, from whichever
    thread it likes. ``on_abort``, when set, is called with each abort request's keys in the
    aborting thread (e.g. to report the cut samples at once, as an engine that stops them
    synchronously would)."""

    def __init__(self) -> None:
        self.streams: Streams | None = None
        #: Every request started, in start order.
        self.started: list[SampleRequest] = []
        #: Every abort request's keys, in order.
        self.abort_calls: list[list[str]] = []
        self.on_abort: Callable[[list[str]], None] | None = None
        self._cond = threading.Condition()

    def start(self, requests: list[SampleRequest]) -> None:
        with self._cond:
            self.started.extend(requests)
            self._cond.notify_all()

    def abort(self, keys: list[str]) -> None:
        with self._cond:
            self.abort_calls.append(list(keys))
            self._cond.notify_all()
        if self.on_abort is not None:
            self.on_abort(list(keys))

    def wait_aborts(self, count: int) -> None:
        """Return once ``count`` abort requests came (from another thread)."""
        with self._cond:
            came = self._cond.wait_for(lambda: len(self.abort_calls) >= count, DEADLINE_S)
        assert came, f"expected {count} abort request(s), got {self.abort_calls}"

    def finish(
        self,
        request: SampleRequest,
        tokens: Sequence[int],
        logprobs: Sequence[float] | None = None,
        *,
        aborted: bool = False,
        error: str | None = None,
    ) -> None:
        """Report the end of the sample started as ``request``."""
        assert self.streams is not None
        self.streams.deliver(
            [FinishedSample(request.key, tuple(tokens), _logprobs(tokens, logprobs), aborted, error)]
        )

    def made(
        self, request: SampleRequest, tokens: Sequence[int], logprobs: Sequence[float] | None = None
    ) -> None:
        """Report new tokens of the sample started as ``request`` (``SampleProgress``)."""
        assert self.streams is not None
        self.streams.progress([SampleProgress(request.key, tuple(tokens), _logprobs(tokens, logprobs))])


def _logprobs(tokens: Sequence[int], logprobs: Sequence[float] | None) -> tuple[float, ...]:
    """``logprobs``, or made-up ones of ``tokens``."""
    return tuple(logprobs) if logprobs is not None else tuple(-0.5 - t / 100 for t in tokens)


def sample_params(max_new_tokens: int = 8) -> SampleParams:
    return SampleParams(
        temperature=0.0,
        top_p=1.0,
        top_k=-1,
        max_new_tokens=max_new_tokens,
        stop_strings=(),
        stop_token_ids=(EOS, STOP),
        seed=None,
    )


class StandInBackend(Recorder):
    """The stand-in (``Recorder``) wired to a ``Streams`` of its own, with the real
    ``rollgen.output.stop_reason`` over the made-up vocabulary (EOS id 2, stop id 3, a context of
    64 tokens, no stop strings)."""

    def __init__(self) -> None:
        super().__init__()
        self.streams = Streams(self.start, self.abort, self._stop_reason)

    @staticmethod
    def _stop_reason(params: SampleParams, end: int, tokens: list[int]) -> str:
        return stop_reason(tokens, end, params, (EOS,), MAX_MODEL_LEN, lambda _: False)

    @property
    def book(self) -> Streams:
        assert self.streams is not None
        return self.streams

    def submit(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int = 8,
        tag: Any = None,
        stream_tokens: bool = False,
    ) -> tuple[Rollout, list[SampleRequest]]:
        """Submit a batch as ``BaseGeneration.submit`` does; returns the rollout and the requests
        started by this call (none while an update holds new samples)."""
        ids, lengths = right_pad([list(p) for p in prompts], PAD, torch.long)
        batch = BatchedDataDict({"input_ids": ids, "input_lengths": lengths})
        rollout = Rollout(self.book, batch, PAD, tag, stream_tokens)
        before = len(self.started)
        self.book.submit(rollout, [tuple(p) for p in prompts], [sample_params(max_new_tokens)] * len(prompts))
        return rollout, self.started[before:]


class InThread:
    """``fn()`` in a daemon thread; ``result()`` joins it and returns its value or raises its
    exception."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self._value: Any = None
        self._error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(fn,), daemon=True)
        self.thread.start()

    def _run(self, fn: Callable[[], Any]) -> None:
        try:
            self._value = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to result()
            self._error = exc

    def still_blocked(self) -> bool:
        """Safety net only: joins briefly and says whether the thread is still running (a thread
        that should be blocked but is not would almost always have ended by then)."""
        self.thread.join(0.2)
        return self.thread.is_alive()

    def result(self) -> Any:
        self.thread.join(DEADLINE_S)
        assert not self.thread.is_alive(), "the thread did not end"
        if self._error is not None:
            raise self._error
        return self._value


def update_in_thread(
    book: Streams, mode: UpdateMode, body: Callable[[], None] = lambda: None, fresh: bool = True
) -> InThread:
    def run() -> None:
        with book.update(mode, fresh=lambda: fresh):
            body()

    return InThread(run)


def drain(rollout: Rollout) -> list[SampleResult]:
    """The results of ``rollout`` not yet taken, to its end. Each must be delivered already: a
    sample still in flight fails the test here rather than blocking it."""
    results = rollout_take(rollout, rollout.size - rollout._results_feed.results_taken)
    assert rollout._next(rollout._results_feed, block=False) is None, (
        "a rollout yielded more results than it has samples"
    )
    return results


def rollout_take(rollout: Rollout, count: int) -> list[SampleResult]:
    """The next ``count`` results of ``rollout``. Each must be delivered already: one that is not
    fails the test here rather than blocking it (``Rollout``'s own iteration waits for it)."""
    results: list[SampleResult] = []
    for _ in range(count):
        result = rollout._next(rollout._results_feed, block=False)
        assert result is not None, f"only {len(results)} of {count} results were delivered"
        results.append(result)
    return results


def by_prompt(requests: Sequence[SampleRequest]) -> dict[tuple[int, ...], SampleRequest]:
    return {r.prompt_ids: r for r in requests}


# ---- BaseGeneration over the book ---------------------------------------------------------------
class PlainGeneration(BaseGeneration):
    """A stand-in engine, not a backend: ``BaseGeneration`` on the tiny model's config without
    streaming hooks of its own; ``_generate`` answers every sample with one EOS token; its
    linked engine's load counts buckets (or raises, when ``fail_apply`` is set), and its KV-cache
    clear calls ``_clear_kv_cache``."""

    def __init__(self, config: Mapping[str, Any], cluster: Any = None, backend: Any = None) -> None:
        super().__init__(config, cluster=cluster, backend=backend)
        self.applied = 0
        self.fail_apply = False
        self.link_engine(InProcessLink(EngineFacts(), self._load, clear_kv=lambda: self._clear_kv_cache()))

    def _generate(self, batch: BatchedDataDict[Any], params: list[SampleParams]) -> BatchedDataDict[Any]:
        eos = self.model_info.eos_token_ids[0]
        return assemble_from_lists(
            batch["input_ids"],
            batch["input_lengths"],
            [[eos]] * batch.size,
            [[-0.5]] * batch.size,
            self.cfg["pad_token_id"],
        )

    def _load(self, named: Named) -> None:
        if self.fail_apply:
            raise RuntimeError("the engine lost a bucket")
        self.applied += 1

    def _clear_kv_cache(self) -> None:
        """Nothing cached here."""


class StandInGeneration(PlainGeneration):
    """``PlainGeneration`` whose streaming hooks are a ``Recorder``: a submitted sample stays in
    flight until the test reports its end (``self.rec.finish``)."""

    def __init__(self, config: Mapping[str, Any], cluster: Any = None, backend: Any = None) -> None:
        self.rec = Recorder()
        super().__init__(config, cluster=cluster, backend=backend)
        self.rec.streams = self._streams

    def _stream_start(self, requests: list[SampleRequest]) -> None:
        self.rec.start(requests)

    def _stream_abort(self, keys: list[str]) -> None:
        self.rec.abort(keys)


ALL_CAPS = frozenset({Capability.LOGPROBS, Capability.ASYNC, Capability.SLEEP_WAKE, Capability.REFIT_TENSORS})


def make(cls: type[PlainGeneration], config: dict[str, Any], caps: frozenset[Capability] = ALL_CAPS) -> Any:
    backend = Backend("standin", "rollout_standins:StandInGeneration", GenerationConfig, caps)
    return cls(config, backend=backend)


def prompts_batch(*prompts: Sequence[int], pad: int) -> dict[str, torch.Tensor]:
    ids, lengths = right_pad([list(p) for p in prompts], pad, torch.long)
    return {"input_ids": ids, "input_lengths": lengths}


def zero_weights(engine: BaseGeneration) -> dict[str, torch.Tensor]:
    """A complete, finite state dict for the served model (one tensor per tied group)."""
    spec = engine.weight_spec
    return {
        name: torch.zeros(shape, dtype=getattr(torch, dtype))
        for name, (shape, dtype) in spec.items()
        if name not in spec.tied
    }
