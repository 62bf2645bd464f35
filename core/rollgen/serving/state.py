"""What the server holds between requests: the served generation, its settings, the sessions,
the requests in flight (by ``request_id``), and one request's turn from admission to its end."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, fields

from rollgen.errors import ConfigError
from rollgen.rollout import SampleResult, TokenDelta
from rollgen.serving.engine import ServedGeneration
from rollgen.serving.errors import HttpError
from rollgen.serving.port import ServedRollout
from rollgen.serving.schemas import ChatCompletionRequest, CompletionRequest
from rollgen.serving.sessions import Session, SessionLimit, Sessions
from rollgen.serving.tools import ToolParser

Request = CompletionRequest | ChatCompletionRequest


@dataclass(frozen=True)
class Limits:
    """The server's limits, each answered in OpenAI's error shape. Every one is positive
    (ConfigError otherwise), but for ``max_concurrent_requests`` and ``max_sessions``, which may
    be 0 (refuse them all)."""

    #: Requests generating at once; past it, 429.
    max_concurrent_requests: int = 1024
    #: Connections open at once (idle kept-alive ones too); past it a new one gets 503 and is
    #: closed. Fewer where the process's limit on open files is lower (a warning says so).
    max_connections: int = 4096
    #: A request body's bytes; past it, 413.
    max_body_bytes: int = 16 * 2**20
    #: Sessions kept; past it, a new session gets 429.
    max_sessions: int = 10_000
    #: How long the server waits on a client: for a request's headers (from its first byte, or
    #: the connection's opening), for its body (408 past either), and for it to take a
    #: response's bytes (its connection is closed past it).
    client_timeout_s: float = 30.0
    #: How long a request waits for the generation (a refit, a wake, a sleep) before 503.
    submit_timeout_s: float = 60.0
    #: The ``Retry-After`` a 503 says.
    retry_after_s: int = 1
    #: Threads that tokenize prompts, render chat templates and read replies (off the event loop).
    text_workers: int = 4

    def __post_init__(self) -> None:
        may_be_zero = ("max_concurrent_requests", "max_sessions")
        bad = [
            f.name for f in fields(self) if not getattr(self, f.name) > (-1 if f.name in may_be_zero else 0)
        ]
        if bad:
            raise ConfigError(f"serving Limits must be positive: {', '.join(bad)}")


class ServerState:
    def __init__(self, served: ServedGeneration, limits: Limits, tool_parser: ToolParser | None) -> None:
        self.served = served
        self.limits = limits
        self.tool_parser = tool_parser
        self.sessions = Sessions(limits.max_sessions)
        #: The turns in flight by ``request_id`` (each registered before its samples are submitted).
        self.requests: dict[str, Turn] = {}
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
    its rollout registered under its ``request_id``, everything released by ``close`` (a
    session that no turn was recorded in is forgotten then)."""

    def __init__(self, state: ServerState, req: Request) -> None:
        self.state, self.req = state, req
        self.session: Session | None = None
        self.rollout: ServedRollout | None = None
        self.prompt: list[int] = []
        self._admitted = False
        self._cancelled = False

    async def open(self, kind: str) -> Session | None:
        """Take the request's session (made on first use), waiting for its previous turn."""
        if self.req.session_id is None:
            return None
        if self.req.n != 1:
            raise HttpError(400, "a session turn takes n=1 (one reply continues a conversation)")
        sessions = self.state.sessions
        while True:
            try:
                session = sessions.open(self.req.session_id)
            except SessionLimit as exc:
                raise HttpError(429, str(exc), "rate_limit_exceeded") from None
            await session.lock.acquire()
            if sessions.holds(session):
                break
            session.lock.release()  # its first turn failed while this one waited: make it anew
        self.session = session
        session.check_kind(kind)
        return session

    async def start(self, prompt: Sequence[int]) -> None:
        self.state.admit()
        self._admitted = True
        self.prompt = list(prompt)
        rid = self.req.request_id
        if rid is not None:
            if rid in self.state.requests:
                raise HttpError(400, f"request_id {rid!r} is in flight already")
            self.state.requests[rid] = self  # before the submit's wait: a second one is refused
        samples = self.state.served.samples(self.prompt, self.req)
        replica = self.session.replica if self.session is not None else None
        self.rollout = await self.state.served.submit(samples, replica, stream_tokens=self.req.stream)
        if self._cancelled:
            self.rollout.cancel()

    def cancel(self) -> None:
        """End the request's samples now (as soon as they are submitted, if they are not yet)."""
        self._cancelled = True
        if self.rollout is not None:
            self.rollout.cancel()

    def _started(self) -> ServedRollout:
        if self.rollout is None:
            raise RuntimeError("a turn's results before Turn.start")
        return self.rollout

    async def results(self) -> AsyncIterator[SampleResult]:
        """Each choice's result as it finishes."""
        async for batch in self._started().batches():
            for result in batch:
                if isinstance(result, SampleResult):
                    yield result

    def events(self) -> AsyncIterator[list[TokenDelta | SampleResult]]:
        """Each choice's tokens as they are made, then its result, in batches of those ready at
        once (a streamed request's)."""
        return self._started().batches()

    def close(self) -> None:
        if self.rollout is not None:
            if not self.rollout.done:  # the client left, or an error: nobody reads the rest
                self.rollout.cancel()
            self.rollout = None
        rid = self.req.request_id
        if rid is not None and self.state.requests.get(rid) is self:
            del self.state.requests[rid]
        if self._admitted:
            self.state.running -= 1
            self._admitted = False
        if self.session is not None:
            self.state.sessions.discard(self.session)
            self.session.lock.release()
            self.session = None


async def collect(turn: Turn) -> list[SampleResult]:
    """Every choice's result, in choice order."""
    results = [r async for r in turn.results()]
    return sorted(results, key=lambda r: r.index)
