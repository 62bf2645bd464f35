"""``rollgen.serve``: the endpoint beside the generation object the trainer keeps calling
(``refit``, ``finish_generation``). Its HTTP side runs in a process of its own by default (the
trainer's process keeps only the generation's end of a pipe, ``rollgen.serving.bridge``), or on
uvicorn in a thread of the trainer's process (``front="thread"``)."""

from __future__ import annotations

import ipaddress
import logging
import os
import pickle
import secrets
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing import Pipe
from pathlib import Path
from typing import Any, Literal

from rollgen.errors import ConfigError, RollgenError, UnsupportedCapability
from rollgen.interface import GenerationInterface
from rollgen.serving.bridge import Bridge
from rollgen.serving.engine import chat_template_of
from rollgen.serving.front import GRACEFUL_S, Front, FrontSpec
from rollgen.serving.port import Facts, LocalPort
from rollgen.serving.state import Limits, ServerState
from rollgen.serving.tools import choose_tool_parser
from rollgen.spec import Capability

logger = logging.getLogger(__name__)

#: How long ``start`` waits for the server to listen.
START_TIMEOUT_S = 60.0
#: Where the HTTP side runs: a process of its own, or a thread of the trainer's process.
FrontKind = Literal["process", "thread"]


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class Server:
    """An OpenAI-compatible endpoint over ``gen`` (a backend that declares ``async``;
    UnsupportedCapability otherwise).

    ``api_key`` None: one is generated (``server.api_key``); ``require_api_key=False`` turns
    auth off, on a loopback host only. ``model_id``: the name clients pass as ``model`` (the
    model folder's name by default; its path is accepted too). ``tool_parser``: a registered
    parser's name, ``"auto"`` (``hermes`` where the chat template writes ``<tool_call>``), or
    None. ``front``: where the HTTP side runs (``"process"``: its own; ``"thread"``: this one,
    where ``server.state`` is its state)."""

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
        front: FrontKind = "process",
    ) -> None:
        if not require_api_key and not is_loopback(host):
            raise ConfigError(
                f"serving on {host!r} without an API key: auth may be off on a loopback host only"
            )
        if require_api_key and api_key is not None and len(api_key) < 16:
            raise ConfigError("api_key must be at least 16 characters (or None: one is generated)")
        if front not in ("process", "thread"):
            raise ConfigError(f"front must be 'process' or 'thread', not {front!r}")
        if Capability.ASYNC not in gen.capabilities:
            raise UnsupportedCapability(gen.name, Capability.ASYNC.value, "serving (rollgen serve)")
        self.gen = gen
        self.api_key = (api_key or secrets.token_urlsafe(32)) if require_api_key else None
        self.generated_key = require_api_key and api_key is None
        tokenizer = getattr(gen, "tokenizer", None)
        if tokenizer is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(gen.cfg["model_name"])
        self.spec = FrontSpec(
            model_id or Path(gen.cfg["model_name"]).name,
            self.api_key,
            limits or Limits(),
            choose_tool_parser(tool_parser, chat_template_of(tokenizer)),
            tokenizer,
            Facts.of(gen),
            log_level,
        )
        self.front = front
        self.host, self._port = host, port
        self._front: Front | None = None
        self._local_port: LocalPort | None = None  # the thread front's
        self._thread: threading.Thread | None = None
        self._failure: BaseException | None = None
        self._bridge: Bridge | None = None
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def model_id(self) -> str:
        return self.spec.model_id

    @property
    def state(self) -> ServerState:
        """The HTTP side's state (``front="thread"`` only, once started)."""
        if self._front is None:
            raise RollgenError("server.state: only a started server with front='thread' has one here")
        return self._front.state

    @property
    def front_pid(self) -> int | None:
        """The HTTP side's process (None with ``front="thread"``, or before ``start``)."""
        return self._process.pid if self._process is not None else None

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
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.host, self._port))
        except OSError as exc:
            sock.close()
            raise ConfigError(f"cannot listen on {self.host}:{self._port}: {exc}") from None
        self._port = sock.getsockname()[1]
        # listening now: a client that connects as soon as start() returns is not refused
        sock.listen(2048)
        try:
            started = self._start_thread(sock) if self.front == "thread" else self._start_process(sock)
        except BaseException:
            self.stop()
            raise
        if not started:
            why = self._failure if self._bridge is None else self._bridge.stopped
            self.stop()
            why = why or f"not serving within {START_TIMEOUT_S:g} s"
            raise RollgenError(f"the server did not start on {self.url}: {why}")
        logger.info("rollgen serving %s (%s) at %s", self.model_id, self.spec.facts.name, self.url)
        return self

    def _start_thread(self, sock: socket.socket) -> bool:
        self._local_port = LocalPort(self.gen)
        front = self._front = Front(self.spec, self._local_port)
        ready = threading.Event()

        def run() -> None:
            try:
                front.run(sock, lambda loop: ready.set())
            except BaseException as exc:  # noqa: BLE001 - start() raises it in the caller's thread
                self._failure = exc
            finally:
                sock.close()
                ready.set()

        self._thread = threading.Thread(target=run, name="rollgen-serve", daemon=True)
        self._thread.start()
        return ready.wait(START_TIMEOUT_S) and self._failure is None and self._thread.is_alive()

    def _start_process(self, sock: socket.socket) -> bool:
        try:
            spec = pickle.dumps(self.spec)
        except (pickle.PicklingError, TypeError, AttributeError) as exc:
            sock.close()
            raise ConfigError(
                f"the server's settings cannot be sent to its process ({exc}): give a tokenizer and "
                "tool parser that pickle, or serve with front='thread'"
            ) from None
        ours, theirs = Pipe()
        # the caller's import path, so the server's process imports this rollgen (and its classes)
        path = os.pathsep.join(p for p in sys.path if p)
        try:
            self._process = subprocess.Popen(
                [sys.executable, "-m", "rollgen.serving", str(theirs.fileno()), str(sock.fileno())],
                pass_fds=(theirs.fileno(), sock.fileno()),
                env={**os.environ, "PYTHONPATH": path},
                # its own session: a Ctrl-C meant for the trainer does not stop it (the pipe's end does)
                start_new_session=True,
            )
        finally:
            theirs.close()
            sock.close()
        self._bridge = Bridge(self.gen, ours)
        self._bridge.start(("setup", list(sys.path), spec))
        serving = self._bridge.serving.wait(START_TIMEOUT_S)
        return serving and self._bridge.stopped is None

    def stop(self) -> None:
        """Refuse new requests (503), let those in flight end, stop listening. Idempotent; the
        generation stays the caller's."""
        if self._front is not None:
            self._front.stop()
        if self._thread is not None:
            self._thread.join(GRACEFUL_S + 10)
            if self._thread.is_alive():
                logger.warning(
                    "the server's thread did not stop in %d s; left to end with the process", GRACEFUL_S + 10
                )
            self._thread = None
        if self._local_port is not None:
            self._local_port.close()
            self._local_port = None
        if self._process is not None:
            if self._bridge is not None:
                self._bridge.stop_server()
            try:
                self._process.wait(GRACEFUL_S + 10)
            except subprocess.TimeoutExpired:
                logger.warning("the server's process did not stop in %d s: killing it", GRACEFUL_S + 10)
                self._process.kill()
                self._process.wait()
            self._process = None
        if self._bridge is not None:
            self._bridge.close()
            self._bridge = None

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
