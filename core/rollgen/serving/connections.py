"""What the server holds per connection, bounded: uvicorn's HTTP protocol with three limits it
lacks. Past ``max_connections`` open ones a new connection is answered 503 and closed at once;
a request's headers must arrive within ``client_timeout_s`` of its first byte (of the
connection's opening, for its first request); a client that stops taking a response's bytes
for ``client_timeout_s`` loses its connection. (A request's body is bounded by
``rollgen.serving.guard``; idle kept-alive connections by uvicorn's own keep-alive timeout.)"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
from typing import Any

from rollgen.serving.errors import HttpError, error_body

logger = logging.getLogger(__name__)

#: File descriptors kept beside the connections' for everything else the process opens.
SPARE_FDS = 256


def refusal(status: int, reason: str, error: HttpError, retry_after_s: int | None = None) -> bytes:
    """A whole HTTP/1.1 response that closes the connection, its body OpenAI's error shape."""
    body = json.dumps(error_body(error)).encode()
    head = [
        f"HTTP/1.1 {status} {reason}",
        "content-type: application/json",
        f"content-length: {len(body)}",
        "connection: close",
    ]
    if retry_after_s is not None:
        head.append(f"retry-after: {retry_after_s}")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def guarded_protocol(max_connections: int, client_timeout_s: float, retry_after_s: int) -> type[Any]:
    """uvicorn's HTTP protocol class (``httptools`` where installed, else ``h11``, as uvicorn's
    ``auto`` picks) with the limits above, for ``uvicorn.Config(http=...)``."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    full = refusal(
        503,
        "Service Unavailable",
        HttpError(
            503,
            f"the server holds its limit of {max_connections} open connections (max_connections); "
            "retry later",
            "too_many_connections",
        ),
        retry_after_s,
    )
    late = refusal(
        408,
        "Request Timeout",
        HttpError(
            408, f"the request's headers did not arrive within {client_timeout_s:g} s (client_timeout_s)"
        ),
    )

    class GuardedProtocol(AutoHTTPProtocol):  # type: ignore[misc, valid-type]
        _refused = False
        #: The two deadlines, apart: a request's headers, and a client taking a response's bytes
        #: (a request that arrives while the client takes none leaves the second armed).
        _headers: asyncio.TimerHandle | None = None
        _reading: asyncio.TimerHandle | None = None

        def connection_made(self, transport: Any) -> None:
            if len(self.connections) >= max_connections:
                self._refused = True
                transport.write(full)
                transport.close()
                return
            super().connection_made(transport)
            self._headers = self._arm(self._headers, self._headers_late)

        def data_received(self, data: bytes) -> None:
            if self._refused:
                return
            if self._headers is None and self._between_requests():
                self._headers = self._arm(self._headers, self._headers_late)
            request = self.cycle
            super().data_received(data)
            if self.cycle is not request:  # a request's headers are in: its app runs now
                self._headers = self._disarm(self._headers)

        def pause_writing(self) -> None:
            super().pause_writing()
            self._reading = self._arm(self._reading, self._not_reading)

        def resume_writing(self) -> None:
            super().resume_writing()
            self._reading = self._disarm(self._reading)

        def connection_lost(self, exc: Exception | None) -> None:
            self._headers = self._disarm(self._headers)
            self._reading = self._disarm(self._reading)
            if not self._refused:
                super().connection_lost(exc)

        def _between_requests(self) -> bool:
            return self.cycle is None or bool(self.cycle.response_complete)

        def _arm(self, deadline: asyncio.TimerHandle | None, fire: Any) -> asyncio.TimerHandle:
            self._disarm(deadline)
            return self.loop.call_later(client_timeout_s, fire)

        @staticmethod
        def _disarm(deadline: asyncio.TimerHandle | None) -> None:
            if deadline is not None:
                deadline.cancel()

        def _headers_late(self) -> None:
            self._headers = None
            if self._between_requests() and not self.transport.is_closing():
                logger.debug("closing a connection whose request did not arrive in %g s", client_timeout_s)
                self.transport.write(late)
                self.transport.close()

        def _not_reading(self) -> None:
            self._reading = None
            logger.info("closing a connection whose client took no response bytes for %g s", client_timeout_s)
            self.transport.abort()

    return GuardedProtocol


def fit_open_files(max_connections: int) -> int:
    """The connections this process can hold open: ``max_connections``, or fewer where the
    limit on open files (raised to its hard limit if need be) leaves no room for them."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = max_connections + SPARE_FDS
    if soft != resource.RLIM_INFINITY and soft < wanted:
        raised = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
            soft = raised
        except (ValueError, OSError) as exc:
            logger.warning("could not raise the limit on open files to %d: %s", raised, exc)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        fitted = max(1, soft - SPARE_FDS)
        logger.warning(
            "this process may open %d files: the server holds at most %d connections, not %d "
            "(max_connections); raise `ulimit -n` for more",
            soft,
            fitted,
            max_connections,
        )
        return fitted
    return max_connections
