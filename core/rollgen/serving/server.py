"""``rollgen.serve``: the endpoint in the trainer's process, on uvicorn in a thread of its own,
beside the generation object the trainer keeps calling (``refit``, ``finish_generation``)."""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import secrets
import socket
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

from rollgen.errors import ConfigError, RollgenError
from rollgen.interface import GenerationInterface
from rollgen.serving.connections import fit_open_files, guarded_protocol
from rollgen.serving.engine import ServedGeneration
from rollgen.serving.state import Limits, ServerState
from rollgen.serving.tools import choose_tool_parser

logger = logging.getLogger(__name__)

#: How long ``start`` waits for uvicorn to listen.
START_TIMEOUT_S = 60.0
#: How long an idle keep-alive connection stays open: well past the 5 s after which httpx (and so
#: the ``openai`` SDK) stops reusing one, so a client never sends on a connection the server is
#: closing (uvicorn's own default is those same 5 s: a request sent as the server closes is lost).
KEEP_ALIVE_S = 60


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class Server:
    """An OpenAI-compatible endpoint over ``gen`` (a backend that declares ``async``).

    ``api_key`` None: one is generated (``server.api_key``); ``require_api_key=False`` turns
    auth off, on a loopback host only. ``model_id``: the name clients pass as ``model`` (the
    model folder's name by default; its path is accepted too). ``tool_parser``: a registered
    parser's name, ``"auto"`` (``hermes`` where the chat template writes ``<tool_call>``), or
    None."""

    def __init__(
        self,
        gen: GenerationInterface,
        host: str = "127.0.0.1",
        port: int = 0,
        api_key: str | None = None,
        *,
        require_api_key: bool = True,
        model_id: str | None = None,
        tool_parser: str | None = "auto",
        limits: Limits | None = None,
        log_level: str = "warning",
    ) -> None:
        if not require_api_key and not is_loopback(host):
            raise ConfigError(
                f"serving on {host!r} without an API key: auth may be off on a loopback host only"
            )
        if require_api_key and api_key is not None and len(api_key) < 16:
            raise ConfigError("api_key must be at least 16 characters (or None: one is generated)")
        self.api_key = (api_key or secrets.token_urlsafe(32)) if require_api_key else None
        self.generated_key = require_api_key and api_key is None
        limits = limits or Limits()
        served = ServedGeneration(
            gen, model_id or Path(gen.cfg["model_name"]).name, limits.submit_timeout_s, limits.text_workers
        )
        self.state = ServerState(served, limits, choose_tool_parser(tool_parser, served.chat_template))
        self.host, self._port = host, port
        self.log_level = log_level
        self._thread: threading.Thread | None = None
        self._uvicorn: Any = None
        self._ready = threading.Event()
        self._failure: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def model_id(self) -> str:
        return self.state.served.model_id

    @property
    def port(self) -> int:
        return self._port

    @property
    def url(self) -> str:
        """The OpenAI base URL (``http://host:port/v1``)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self._port}/v1"

    def start(self) -> Server:
        """Listen (port 0: a free one, then ``port`` says which) and return once serving."""
        import uvicorn

        from rollgen.serving.app import build_app

        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.host, self._port))
        except OSError as exc:
            sock.close()
            raise ConfigError(f"cannot listen on {self.host}:{self._port}: {exc}") from None
        self._port = sock.getsockname()[1]

        @asynccontextmanager
        async def lifespan(app: Any) -> AsyncIterator[None]:
            self._loop = asyncio.get_running_loop()
            self._ready.set()
            yield
            self.state.closing = True

        app = build_app(self.state, self.api_key, lifespan)
        limits = self.state.limits
        config = uvicorn.Config(
            app,
            http=guarded_protocol(
                fit_open_files(limits.max_connections), limits.client_timeout_s, limits.retry_after_s
            ),
            log_level=self.log_level,
            lifespan="on",
            timeout_graceful_shutdown=30,
            timeout_keep_alive=KEEP_ALIVE_S,
        )
        # listening now: uvicorn runs the lifespan's startup (which says ready) before it listens,
        # and a client that connects as soon as start() returns would be refused
        sock.listen(config.backlog)
        self._uvicorn = uvicorn.Server(config)

        def run() -> None:
            try:
                self._uvicorn.run(sockets=[sock])
            except BaseException as exc:  # noqa: BLE001 - start() raises it in the caller's thread
                self._failure = exc
            finally:
                sock.close()
                self._ready.set()

        self._thread = threading.Thread(target=run, name="rollgen-serve", daemon=True)
        self._thread.start()
        if not self._ready.wait(START_TIMEOUT_S) or self._failure is not None or not self._thread.is_alive():
            self.stop()
            raise RollgenError(f"the server did not start on {self.url}: {self._failure!r}")
        logger.info("rollgen serving %s (%s) at %s", self.model_id, self.state.served.gen.name, self.url)
        return self

    def stop(self) -> None:
        """Refuse new requests (503), let those in flight end, stop listening. Idempotent; the
        generation stays the caller's."""
        self.state.closing = True
        if self._loop is not None and not self._loop.is_closed():
            try:
                self._loop.call_soon_threadsafe(self.state.served.close)
            except RuntimeError:  # the loop closed meanwhile: nothing waits in it
                logger.debug("the server's loop closed before stop")
        if self._uvicorn is not None:
            self._uvicorn.should_exit = True
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.state.served.stop_workers()

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextmanager
def serve(
    gen: GenerationInterface,
    host: str = "127.0.0.1",
    port: int = 0,
    api_key: str | None = None,
    **options: Any,
) -> Iterator[Server]:
    """``with rollgen.serve(gen) as server:`` an OpenAI-compatible endpoint at ``server.url``
    (key ``server.api_key``) while the block runs; options as ``Server`` takes them."""
    with Server(gen, host, port, api_key, **options) as server:
        yield server
