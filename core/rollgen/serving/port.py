"""What the server asks of the generation it serves, as one small async interface (``Port``):
submit a request's samples, cancel them, wait for the generation to be ready, read its state.
``LocalPort`` is the generation itself (the server in the trainer's process); the bridge's
``RemotePort`` (``rollgen.serving.bridge``) reaches it from the server's own process."""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import torch

from rollgen.interface import GenerationInterface
from rollgen.rollout import Rollout, SampleResult, TokenDelta

logger = logging.getLogger(__name__)

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
    """The generation itself: ``submit`` on the default executor (it may wait for the trainer's
    refit), ``wait_ready`` on a daemon thread (one the server's shutdown need not wait for)."""

    def __init__(self, gen: GenerationInterface) -> None:
        self.gen = gen
        self.facts = Facts.of(gen)

    async def submit(self, samples: Samples, replica: int | None, stream_tokens: bool) -> LocalRollout:
        submit = functools.partial(
            self.gen.submit, samples.batch(), replica=replica, stream_tokens=stream_tokens
        )
        future = asyncio.get_running_loop().run_in_executor(None, submit)
        try:
            return LocalRollout(await asyncio.shield(future))
        except asyncio.CancelledError:  # its asker left (or the server stops): no one reads it
            future.add_done_callback(cancel_late)
            raise

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


def live_of(gen: GenerationInterface) -> Live:
    return Live(gen.weight_version, gen.usable, [asdict(r) for r in gen.replica_load()])


def cancel_late(future: asyncio.Future[Rollout]) -> None:
    """Cancel the rollout of a submit whose asker left before it returned."""
    if not future.cancelled() and future.exception() is None:
        future.result().cancel()


def settle(future: asyncio.Future[bool], value: bool) -> None:
    if not future.done():
        future.set_result(value)
