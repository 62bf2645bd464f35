"""What the server holds between requests: the served generation, its settings, the sessions,
the requests in flight (by ``request_id``), and one request's turn from admission to its end."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from rollgen.rollout import Rollout, SampleResult
from rollgen.serving.engine import ServedGeneration
from rollgen.serving.errors import HttpError
from rollgen.serving.schemas import ChatCompletionRequest, CompletionRequest
from rollgen.serving.sessions import Session, SessionLimit, Sessions
from rollgen.serving.tools import ToolParser

Request = CompletionRequest | ChatCompletionRequest


@dataclass(frozen=True)
class Limits:
    """The server's limits, each answered in OpenAI's error shape."""

    #: Requests generating at once; past it, 429.
    max_concurrent_requests: int = 1024
    #: A request body's bytes; past it, 413.
    max_body_bytes: int = 16 * 2**20
    #: Sessions kept; past it, a new session gets 429.
    max_sessions: int = 10_000
    #: How long a request waits for the generation (a refit, a wake, a sleep) before 503.
    submit_timeout_s: float = 60.0
    #: The ``Retry-After`` a 503 says.
    retry_after_s: int = 1


class ServerState:
    def __init__(self, served: ServedGeneration, limits: Limits, tool_parser: ToolParser | None) -> None:
        self.served = served
        self.limits = limits
        self.tool_parser = tool_parser
        self.sessions = Sessions(limits.max_sessions)
        self.requests: dict[str, Rollout] = {}
        self.running = 0
        self.closing = False

    def admit(self) -> None:
        if self.closing:
            raise HttpError(503, "the server is shutting down", "server_shutting_down", retry=True)
        if self.running >= self.limits.max_concurrent_requests:
            raise HttpError(
                429,
                f"{self.running} requests are generating, the server's limit "
                "(max_concurrent_requests); retry later",
                "rate_limit_exceeded",
            )
        self.running += 1


class Turn:
    """One request, from admission to its end: its session held (locked) while it generates,
    its rollout registered under its ``request_id``, everything released by ``close``."""

    def __init__(self, state: ServerState, req: Request) -> None:
        self.state, self.req = state, req
        self.session: Session | None = None
        self.rollout: Rollout | None = None
        self.prompt: list[int] = []
        self._admitted = False

    async def open(self, kind: str) -> Session | None:
        """Take the request's session (made on first use), waiting for its previous turn."""
        if self.req.session_id is None:
            return None
        if self.req.n != 1:
            raise HttpError(400, "a session turn takes n=1 (one reply continues a conversation)")
        try:
            session = self.state.sessions.get(self.req.session_id, create=True)
        except SessionLimit as exc:
            raise HttpError(429, str(exc), "rate_limit_exceeded") from None
        await session.lock.acquire()
        self.session = session
        session.check_kind(kind)
        return session

    async def start(self, prompt: Sequence[int]) -> None:
        self.state.admit()
        self._admitted = True
        self.prompt = list(prompt)
        rid = self.req.request_id
        if rid is not None and rid in self.state.requests:
            raise HttpError(400, f"request_id {rid!r} is in flight already")
        batch = self.state.served.batch(self.prompt, self.req)
        replica = self.session.replica if self.session is not None else None
        self.rollout = await self.state.served.submit(batch, replica)
        if rid is not None:
            self.state.requests[rid] = self.rollout

    async def results(self) -> AsyncIterator[SampleResult]:
        """Each choice's result as it finishes."""
        if self.rollout is None:
            raise RuntimeError("Turn.results before Turn.start")
        async for result in self.rollout:
            yield result

    def close(self) -> None:
        if self.rollout is not None:
            if not self.rollout.done:  # the client left, or an error: nobody reads the rest
                self.rollout.cancel()
            if self.req.request_id is not None:
                self.state.requests.pop(self.req.request_id, None)
            self.rollout = None
        if self._admitted:
            self.state.running -= 1
            self._admitted = False
        if self.session is not None:
            self.session.lock.release()
            self.session = None


async def collect(turn: Turn) -> list[SampleResult]:
    """Every choice's result, in choice order."""
    results = [r async for r in turn.results()]
    return sorted(results, key=lambda r: r.index)
