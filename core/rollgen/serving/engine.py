"""The served generation: requests → ``submit`` batches, the model's tokenizer and chat template.
Every request is a streamed rollout, so a refit the trainer makes while serving treats requests
in flight as its ``mode`` says (``wait``, ``abort``, ``keep``). Work that grows with what a
client sends or a model writes (tokenizing, rendering, parsing) runs on worker threads
(``off_loop``), never on the event loop."""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import torch

from rollgen.errors import EngineAsleep, InputError, StaleWeights, UnsupportedCapability
from rollgen.interface import GenerationInterface
from rollgen.rollout import Rollout
from rollgen.serving.errors import HttpError
from rollgen.serving.schemas import ChatCompletionRequest, CompletionRequest
from rollgen.serving.streaming import IncrementalText, StreamedText
from rollgen.spec import Capability

logger = logging.getLogger(__name__)
_T = TypeVar("_T")


class ServedGeneration:
    """A generation as the server uses it. Raises UnsupportedCapability unless the backend
    declares ``async`` (the server streams every request)."""

    def __init__(
        self, gen: GenerationInterface, model_id: str, submit_timeout_s: float, text_workers: int = 4
    ) -> None:
        if Capability.ASYNC not in gen.capabilities:
            raise UnsupportedCapability(gen.name, Capability.ASYNC.value, "serving (rollgen serve)")
        self.gen = gen
        self.model_id = model_id
        self.submit_timeout_s = submit_timeout_s
        tokenizer = getattr(gen, "tokenizer", None)
        if tokenizer is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(gen.cfg["model_name"])
        self.tokenizer = tokenizer
        #: Requests waiting for the generation to wake or be refitted; the thread that waits.
        self.waiting = 0
        self._ready: asyncio.Future[bool] | None = None
        self._closing = False
        self._text = ThreadPoolExecutor(text_workers, thread_name_prefix="rollgen-serve-text")

    async def off_loop(self, work: Callable[..., _T], *args: Any) -> _T:
        """``work(*args)`` on one of the text workers (tokenizing, rendering, parsing: work
        that grows with a request or a reply stays off the event loop)."""
        return await asyncio.get_running_loop().run_in_executor(self._text, functools.partial(work, *args))

    @property
    def chat_template(self) -> str | None:
        template = getattr(self.tokenizer, "chat_template", None)
        return template if isinstance(template, str) else None

    @property
    def logprobs_mode(self) -> str:
        return str(self.gen.cfg.get("logprobs_mode", "raw"))

    def render(self, messages: list[dict[str, Any]], generation_prompt: bool, tools: Any = None) -> str:
        """The chat template's text for ``messages`` (``tools`` handed to the template);
        InputError for messages or tools the template cannot render."""
        from jinja2 import TemplateError

        if self.chat_template is None:
            raise InputError(f"model {self.model_id!r} has no chat template; use /v1/completions")
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tools=tools, add_generation_prompt=generation_prompt, tokenize=False
            )
        except (TemplateError, TypeError, ValueError, KeyError, AttributeError) as exc:
            raise InputError(
                f"the chat template cannot render these messages or tools ({type(exc).__name__}: {exc})"
            ) from None
        return str(text)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=True))

    def token_text(self, token_id: int) -> str:
        return str(self.tokenizer.decode([token_id]))

    def text_stream(self) -> IncrementalText | StreamedText:
        """A new incremental decoder of a reply's text (special tokens skipped): the fast
        tokenizer's own where there is one, else windowed decodes."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        return StreamedText(backend) if backend is not None else IncrementalText(self.decode)

    def batch(self, prompt: Sequence[int], req: CompletionRequest | ChatCompletionRequest) -> dict[str, Any]:
        """``n`` copies of ``prompt`` with the request's sampling settings as per-sample keys
        (only those it sets: the rest are the config's). ``seed`` s gives choice i seed s + i."""
        n = req.n
        batch: dict[str, Any] = {
            "input_ids": torch.tensor([list(prompt)] * n, dtype=torch.long).reshape(n, len(prompt)),
            "input_lengths": torch.full((n,), len(prompt), dtype=torch.long),
        }
        budget = getattr(req, "max_completion_tokens", None) or req.max_tokens
        for key, value in (
            ("temperature", req.temperature),
            ("top_p", req.top_p),
            ("top_k", req.top_k),
            ("max_new_tokens", budget),
        ):
            if value is not None:
                batch[key] = torch.full((n,), value)
        if req.seed is not None:
            batch["seed"] = torch.arange(req.seed, req.seed + n, dtype=torch.long)
        if req.stop_strings():
            batch["stop_strings"] = [req.stop_strings()] * n
        return batch

    async def submit(
        self, batch: dict[str, Any], replica: int | None = None, stream_tokens: bool = False
    ) -> Rollout:
        """``gen.submit(batch)`` off the event loop. It waits while the trainer holds the
        generation (a refit, a wake), has put it to sleep (``finish_generation``) or left its
        weights stale (a refit failed part-way), up to ``submit_timeout_s`` in all, then a 503
        with ``Retry-After`` (a rollout that starts after that is cancelled at once).
        ``replica``: the one to prefer (a session's last), as ``gen.submit`` takes it;
        ``stream_tokens``: the rollout reports tokens as they are made."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.submit_timeout_s
        submit = functools.partial(self.gen.submit, batch, replica=replica, stream_tokens=stream_tokens)
        while True:
            started = loop.run_in_executor(None, submit)
            try:
                return await asyncio.wait_for(asyncio.shield(started), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                started.add_done_callback(_cancel_late)
                raise self._late("the generation was busy (the trainer's refit or wake)") from None
            except (EngineAsleep, StaleWeights) as exc:
                if not await self._wait_ready(deadline):
                    raise self._late(str(exc), type(exc).__name__) from None

    async def _wait_ready(self, deadline: float) -> bool:
        """Whether the generation became ready (or can never be: the next submit says why)
        before ``deadline`` (the loop's clock). One thread waits in ``gen.wait_ready`` for
        every request that waits."""
        loop = asyncio.get_running_loop()
        self.waiting += 1
        try:
            while (left := deadline - loop.time()) > 0:
                if self._ready is None or self._ready.done():
                    self._ready = _watch_ready(self.gen, loop, self.submit_timeout_s)
                try:
                    await asyncio.wait_for(asyncio.shield(self._ready), left)
                except asyncio.TimeoutError:
                    return False
                if self._closing:
                    raise HttpError(503, "the server is shutting down", "server_shutting_down", retry=True)
                if self._ready.result() or not self.gen.usable:
                    return True
            return False
        finally:
            self.waiting -= 1

    def close(self) -> None:
        """The server stops (call in its event loop): requests waiting for the generation get
        503 now rather than at their timeout."""
        self._closing = True
        if self._ready is not None:
            _settle(self._ready, False)

    def stop_workers(self) -> None:
        """End the text workers (once the server has stopped: requests still use them before)."""
        self._text.shutdown(wait=True, cancel_futures=True)

    def _late(self, why: str, code: str = "generation_busy") -> HttpError:
        return HttpError(
            503, f"{why}; waited {self.submit_timeout_s:g} s (submit_timeout_s)", code, retry=True
        )


def _watch_ready(
    gen: GenerationInterface, loop: asyncio.AbstractEventLoop, timeout_s: float
) -> asyncio.Future[bool]:
    """A future of ``gen.wait_ready(timeout_s)``, waited for in a daemon thread (one the
    server's shutdown need not wait for)."""
    future: asyncio.Future[bool] = loop.create_future()

    def wait() -> None:
        ready = gen.wait_ready(timeout_s)
        try:
            loop.call_soon_threadsafe(_settle, future, ready)
        except RuntimeError:  # the server stopped meanwhile: nobody waits
            logger.debug("the server stopped while requests waited for the generation")

    threading.Thread(target=wait, name="rollgen-serve-ready", daemon=True).start()
    return future


def _settle(future: asyncio.Future[bool], ready: bool) -> None:
    if not future.done():
        future.set_result(ready)


def _cancel_late(started: asyncio.Future[Rollout]) -> None:
    if not started.cancelled() and started.exception() is None:
        started.result().cancel()
