"""What the server asks of the generation it serves, as one small async interface (``Port``):
submit a request's samples, cancel them, wait for the generation to be ready, read its state.
``LocalPort`` is the generation itself (the server in the trainer's process); the bridge's
``RemotePort`` (``rollgen.serving.bridge``) reaches it from the server's own process."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import torch

from rollgen.interface import GenerationInterface
from rollgen.rollout import Rollout, SampleResult, TokenDelta

logger = logging.getLogger(__name__)

#: How long closing waits for the submitting thread to submit what was queued and end.
CLOSE_TIMEOUT_S = 30.0

#: What a rollout hands on at once: a streamed one's tokens and results, else its results.
Events = list[TokenDelta | SampleResult]


@dataclass(frozen=True)
class Facts:
    """What the server knows of its generation from the start (it does not change)."""

    name: str
    model_name: str
    logprobs_mode: str
    max_model_len: int | None
    capabilities: tuple[str, ...]

    @classmethod
    def of(cls, gen: GenerationInterface) -> Facts:
        return cls(
            gen.name,
            str(gen.cfg["model_name"]),
            str(gen.cfg.get("logprobs_mode", "raw")),
            gen.max_model_len,
            tuple(sorted(c.value for c in gen.capabilities)),
        )


@dataclass(frozen=True)
class Samples:
    """One request's samples: ``n`` copies of ``prompt`` with the sampling settings it sets
    (None: the config's). ``seed`` s gives sample i seed s + i."""

    prompt: tuple[int, ...]
    n: int
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    max_new_tokens: int | None = None
    seed: int | None = None
    stop_strings: tuple[str, ...] = ()

    def batch(self) -> dict[str, Any]:
        """The batch ``submit`` takes: the settings set as per-sample keys."""
        n, length = self.n, len(self.prompt)
        batch: dict[str, Any] = {
            "input_ids": torch.tensor([list(self.prompt)] * n, dtype=torch.long).reshape(n, length),
            "input_lengths": torch.full((n,), length, dtype=torch.long),
        }
        for key in ("temperature", "top_p", "top_k", "max_new_tokens"):
            value = getattr(self, key)
            if value is not None:
                batch[key] = torch.full((n,), value)
        if self.seed is not None:
            batch["seed"] = torch.arange(self.seed, self.seed + n, dtype=torch.long)
        if self.stop_strings:
            batch["stop_strings"] = [list(self.stop_strings)] * n
        return batch


@dataclass(frozen=True)
class Live:
    """What the server reads of its generation when asked (``/v1/rollgen/status``)."""

    weight_version: int
    usable: bool
    replicas: list[dict[str, Any]]


class ServedRollout(Protocol):
    """A request's rollout as the server reads it."""

    @property
    def done(self) -> bool: ...

    def batches(self) -> AsyncIterator[Events]: ...

    def cancel(self) -> None: ...


class Port(Protocol):
    """The generation as the server reaches it. ``submit`` raises what ``gen.submit`` does
    (``EngineAsleep`` and ``StaleWeights`` while the trainer holds it); cancelled, it cancels
    the rollout it makes, whenever that comes."""

    facts: Facts

    async def submit(self, samples: Samples, replica: int | None, stream_tokens: bool) -> ServedRollout: ...

    async def wait_ready(self, timeout_s: float) -> tuple[bool, bool]:
        """Whether the generation became ready within ``timeout_s``, and whether it is usable."""
        ...

    async def live(self) -> Live: ...


class LocalRollout:
    """A ``Rollout`` of this process as the server reads it."""

    def __init__(self, rollout: Rollout) -> None:
        self.rollout = rollout

    @property
    def done(self) -> bool:
        return self.rollout.done

    def batches(self) -> AsyncIterator[Events]:
        if self.rollout.stream_tokens:
            return self.rollout.events().batches()
        return self.rollout.result_batches()  # type: ignore[return-value]

    def cancel(self) -> None:
        self.rollout.cancel()


class LocalPort:
    """The generation itself: ``submit`` on a thread of its own (it may wait for the trainer's
    refit; ``Submitter``), ``wait_ready`` on a daemon thread (one the server's shutdown need not
    wait for). ``close`` ends the submitting thread."""

    def __init__(self, gen: GenerationInterface) -> None:
        self.gen = gen
        self.facts = Facts.of(gen)
        self._submitter = Submitter(gen)

    async def submit(self, samples: Samples, replica: int | None, stream_tokens: bool) -> LocalRollout:
        return LocalRollout(await self._submitter.submit(samples, replica, stream_tokens))

    async def wait_ready(self, timeout_s: float) -> tuple[bool, bool]:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[bool] = loop.create_future()

        def wait() -> None:
            ready = self.gen.wait_ready(timeout_s)
            try:
                loop.call_soon_threadsafe(settle, future, ready)
            except RuntimeError:  # the server stopped meanwhile: nobody waits
                logger.debug("the server stopped while requests waited for the generation")

        threading.Thread(target=wait, name="rollgen-serve-ready", daemon=True).start()
        return await future, self.gen.usable

    async def live(self) -> Live:
        return live_of(self.gen)

    def close(self) -> None:
        self._submitter.close()


@dataclass
class _Submit:
    """A request waiting for its submit, and where its rollout goes."""

    samples: Samples
    replica: int | None
    stream_tokens: bool
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Rollout]
    outcome: Rollout | BaseException | None = None


class Submitter:
    """Submits requests' samples to ``gen`` on one thread: the requests that arrive while it
    submits are submitted next, in order, and their rollouts go back to their event loop
    together (one wake-up of the loop a round, not one thread hand-off a request). A request
    whose asker left before its rollout came back has that rollout cancelled."""

    def __init__(self, gen: GenerationInterface) -> None:
        self.gen = gen
        self._queue: queue.SimpleQueue[_Submit | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()

    async def submit(self, samples: Samples, replica: int | None, stream_tokens: bool) -> Rollout:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Rollout] = loop.create_future()
        self._ensure_thread()
        self._queue.put(_Submit(samples, replica, stream_tokens, loop, future))
        return await future

    def close(self) -> None:
        """End the thread once what was queued is submitted."""
        with self._start_lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(None)
            thread.join(CLOSE_TIMEOUT_S)
            if thread.is_alive():  # a submit waiting for the generation (a refit holds it)
                logger.warning(
                    "the submitting thread did not end in %g s; left to end with the process", CLOSE_TIMEOUT_S
                )

    def _ensure_thread(self) -> None:
        with self._start_lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="rollgen-serve-submit", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while (first := self._queue.get()) is not None:
            round_ = [first]
            stop = False
            while not self._queue.empty():
                item = self._queue.get()
                if item is None:
                    stop = True
                    break
                round_.append(item)
            for item in round_:
                item.outcome = self._submit(item)
            for loop in {item.loop for item in round_}:
                mine = [item for item in round_ if item.loop is loop]
                try:
                    loop.call_soon_threadsafe(hand_back, mine)
                except RuntimeError:  # the loop is closed: nobody reads these rollouts
                    for item in mine:
                        if isinstance(item.outcome, Rollout):
                            item.outcome.cancel()
            if stop:
                return

    def _submit(self, item: _Submit) -> Rollout | BaseException:
        try:
            return self.gen.submit(
                item.samples.batch(), replica=item.replica, stream_tokens=item.stream_tokens
            )
        except Exception as exc:  # noqa: BLE001 - handed to the request that asked (its caller types it)
            return exc


def hand_back(items: list[_Submit]) -> None:
    """In the asker's loop: each rollout (or error) to its request; cancel those no one awaits."""
    for item in items:
        outcome = item.outcome
        if item.future.cancelled():
            if isinstance(outcome, Rollout):
                outcome.cancel()
        elif isinstance(outcome, Rollout):
            item.future.set_result(outcome)
        elif outcome is not None:
            item.future.set_exception(outcome)


def live_of(gen: GenerationInterface) -> Live:
    return Live(gen.weight_version, gen.usable, [asdict(r) for r in gen.replica_load()])


def settle(future: asyncio.Future[bool], value: bool) -> None:
    if not future.done():
        future.set_result(value)
