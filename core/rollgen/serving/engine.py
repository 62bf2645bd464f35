"""The served generation: requests → the port's ``submit``, the model's tokenizer and chat
template. Every request is a streamed rollout, so a refit the trainer makes while serving treats
requests in flight as its ``mode`` says (``wait``, ``abort``, ``keep``). Work that grows with what
a client sends or a model writes (tokenizing, rendering, parsing) runs on worker threads
(``off_loop``), never on the event loop."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from rollgen.errors import EngineAsleep, InputError, StaleWeights
from rollgen.serving.errors import HttpError
from rollgen.serving.port import Port, Samples, ServedRollout
from rollgen.serving.schemas import ChatCompletionRequest, CompletionRequest
from rollgen.serving.streaming import IncrementalText, StreamedText

logger = logging.getLogger(__name__)
_T = TypeVar("_T")


class ServedGeneration:
    """The generation as the server uses it, through ``port``, with ``tokenizer`` (the model's)."""

    def __init__(
        self, port: Port, tokenizer: Any, model_id: str, submit_timeout_s: float, text_workers: int = 4
    ) -> None:
        self.port = port
        self.facts = port.facts
        self.model_id = model_id
        self.submit_timeout_s = submit_timeout_s
        self.tokenizer = tokenizer
        #: Requests waiting for the generation to wake or be refitted; the wait they share.
        self.waiting = 0
        self._ready: asyncio.Future[tuple[bool, bool]] | None = None
        self._closing = False
        self._text = ThreadPoolExecutor(text_workers, thread_name_prefix="rollgen-serve-text")

    async def off_loop(self, work: Callable[..., _T], *args: Any) -> _T:
        """``work(*args)`` on one of the text workers (tokenizing, rendering, parsing: work
        that grows with a request or a reply stays off the event loop)."""
        return await asyncio.get_running_loop().run_in_executor(self._text, functools.partial(work, *args))

    @property
    def chat_template(self) -> str | None:
        return chat_template_of(self.tokenizer)

    @property
    def logprobs_mode(self) -> str:
        return self.facts.logprobs_mode

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

    @staticmethod
    def samples(prompt: Sequence[int], req: CompletionRequest | ChatCompletionRequest) -> Samples:
        """``req.n`` samples of ``prompt`` with the request's sampling settings."""
        return Samples(
            tuple(prompt),
            req.n,
            req.temperature,
            req.top_p,
            req.top_k,
            getattr(req, "max_completion_tokens", None) or req.max_tokens,
            req.seed,
            tuple(req.stop_strings()),
        )

    async def submit(
        self, samples: Samples, replica: int | None = None, stream_tokens: bool = False
    ) -> ServedRollout:
        """``samples`` submitted. It waits while the trainer holds the generation (a refit, a
        wake), has put it to sleep (``finish_generation``) or left its weights stale (a refit
        failed part-way), up to ``submit_timeout_s`` in all, then a 503 with ``Retry-After`` (a
        rollout that starts after that is cancelled at once). ``replica``: the one to prefer (a
        session's last); ``stream_tokens``: the rollout reports tokens as they are made."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.submit_timeout_s
        while True:
            # cancelled at the deadline (or when its client leaves): the port cancels its rollout
            submit = self.port.submit(samples, replica, stream_tokens)
            try:
                return await asyncio.wait_for(submit, max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                raise self._late("the generation was busy (the trainer's refit or wake)") from None
            except (EngineAsleep, StaleWeights) as exc:
                if not await self._wait_ready(deadline):
                    raise self._late(str(exc), type(exc).__name__) from None

    async def _wait_ready(self, deadline: float) -> bool:
        """Whether the generation became ready (or can never be: the next submit says why)
        before ``deadline`` (the loop's clock). One wait serves every request that waits."""
        loop = asyncio.get_running_loop()
        self.waiting += 1
        try:
            while (left := deadline - loop.time()) > 0:
                if self._ready is None or self._ready.done():
                    self._ready = loop.create_future()
                    waited = asyncio.ensure_future(self.port.wait_ready(self.submit_timeout_s))
                    waited.add_done_callback(functools.partial(_answered, self._ready))
                try:
                    await asyncio.wait_for(asyncio.shield(self._ready), left)
                except asyncio.TimeoutError:
                    return False
                if self._closing:
                    raise HttpError(503, "the server is shutting down", "server_shutting_down", retry=True)
                ready, usable = self._ready.result()
                if ready or not usable:
                    return True
            return False
        finally:
            self.waiting -= 1

    def close(self) -> None:
        """The server stops (call in its event loop): requests waiting for the generation get
        503 now rather than at their timeout."""
        self._closing = True
        if self._ready is not None and not self._ready.done():
            self._ready.set_result((False, True))

    def stop_workers(self) -> None:
        """End the text workers (once the server has stopped: requests still use them before)."""
        self._text.shutdown(wait=True, cancel_futures=True)

    def _late(self, why: str, code: str = "generation_busy") -> HttpError:
        return HttpError(
            503, f"{why}; waited {self.submit_timeout_s:g} s (submit_timeout_s)", code, retry=True
        )


def chat_template_of(tokenizer: Any) -> str | None:
    template = getattr(tokenizer, "chat_template", None)
    return template if isinstance(template, str) else None


def _answered(ready: asyncio.Future[tuple[bool, bool]], waited: asyncio.Future[tuple[bool, bool]]) -> None:
    """``ready`` answered by the port's wait (one that failed: not usable, the next submit says why)."""
    if ready.done():
        return
    if waited.cancelled() or waited.exception() is not None:
        ready.set_result((False, False))
    else:
        ready.set_result(waited.result())
