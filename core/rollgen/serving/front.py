"""The server's HTTP side (``Front``): the app over a ``ServedGeneration`` on uvicorn, within
its limits. ``rollgen.serve`` runs it in a process of its own (``python -m
rollgen.serving``, the default: parsing, tokenizing and writing answers then take nothing
from the trainer's process, whose driver feeds the engines) or in a thread of the trainer's
process (``front="thread"``)."""

from __future__ import annotations

import asyncio
import logging
import pickle
import socket
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from rollgen.serving.connections import fit_open_files, guarded_protocol
from rollgen.serving.engine import ServedGeneration
from rollgen.serving.port import Facts, Port
from rollgen.serving.state import Limits, ServerState
from rollgen.serving.tools import ToolParser

logger = logging.getLogger(__name__)

#: How long an idle keep-alive connection stays open: well past the 5 s after which httpx (and so
#: the ``openai`` SDK) stops reusing one, so a client never sends on a connection the server is
#: closing (uvicorn's own default is those same 5 s: a request sent as the server closes is lost).
KEEP_ALIVE_S = 60
#: How long the server lets requests in flight end once asked to stop.
GRACEFUL_S = 30


@dataclass
class FrontSpec:
    """Everything the HTTP side needs (sent to its process, pickled, as its first message)."""

    model_id: str
    api_key: str | None
    limits: Limits
    tool_parser: ToolParser | None
    tokenizer: Any
    facts: Facts
    log_level: str


class Front:
    """The app over ``port``; ``run`` serves until ``stop`` (from any thread)."""

    def __init__(self, spec: FrontSpec, port: Port) -> None:
        limits = spec.limits
        served = ServedGeneration(
            port, spec.tokenizer, spec.model_id, limits.submit_timeout_s, limits.text_workers
        )
        self.spec = spec
        self.state = ServerState(served, limits, spec.tool_parser)
        self._uvicorn: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def run(self, sock: socket.socket, serving: Callable[[asyncio.AbstractEventLoop], None]) -> None:
        """Serve on ``sock`` (listening) until stopped; ``serving(loop)`` once requests are taken."""
        import uvicorn

        from rollgen.serving.app import build_app

        @asynccontextmanager
        async def lifespan(app: Any) -> AsyncIterator[None]:
            self._loop = asyncio.get_running_loop()
            serving(self._loop)
            yield
            self.state.closing = True

        limits = self.spec.limits
        config = uvicorn.Config(
            build_app(self.state, self.spec.api_key, lifespan),
            http=guarded_protocol(
                fit_open_files(limits.max_connections), limits.client_timeout_s, limits.retry_after_s
            ),
            log_level=self.spec.log_level,
            lifespan="on",
            timeout_graceful_shutdown=GRACEFUL_S,
            timeout_keep_alive=KEEP_ALIVE_S,
        )
        self._uvicorn = uvicorn.Server(config)
        try:
            self._uvicorn.run(sockets=[sock])
        finally:
            self.state.served.stop_workers()

    def stop(self) -> None:
        """Refuse new requests (503), let those in flight end, stop listening."""
        self.state.closing = True
        if self._loop is not None and not self._loop.is_closed():
            try:
                self._loop.call_soon_threadsafe(self.state.served.close)
            except RuntimeError:  # the loop closed meanwhile: nothing waits in it
                logger.debug("the server's loop closed before stop")
        if self._uvicorn is not None:
            self._uvicorn.should_exit = True


def main(conn_fd: int, sock_fd: int) -> None:
    """The server's process: its import path, then its ``FrontSpec``, come through the pipe
    ``conn_fd`` (inherited from the trainer's process, which alone holds the other end); it
    serves on the listening socket ``sock_fd`` until the trainer asks it to stop or is gone."""
    from rollgen.serving.bridge import RemotePort

    conn = Connection(conn_fd)
    _, path, pickled = conn.recv()[0]  # the bridge's first message: ("setup", ...)
    sys.path[:] = path
    spec: FrontSpec = pickle.loads(pickled)
    logging.basicConfig(level=spec.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    sock = socket.socket(fileno=sock_fd)
    front: Front | None = None
    port = RemotePort(conn, spec.facts, lambda: front.stop() if front is not None else None)
    front = Front(spec, port)

    def serving(loop: asyncio.AbstractEventLoop) -> None:
        port.start(loop)
        port.pipe.post(("serving",))

    reason = "stopped"
    try:
        front.run(sock, serving)
    except BaseException as exc:
        reason = f"{type(exc).__name__}: {exc}"
        raise
    finally:
        port.pipe.close(("stopped", reason))
        sock.close()
