"""Refit channels: the driver hands each engine rank its refit buckets over a local socket of
its own, past the Ray call to the engine's actor and the engine's RPC to its ranks (about 30
times a channel's round trip; BENCHMARKS.md has the figures).

A rank opens a ``ChannelServer`` (a thread that accepts connections) and returns its address;
the driver connects a ``Channel`` to it. Sockets are Unix sockets in the abstract namespace, so
they reach the ranks on the driver's machine only: where a rank runs elsewhere, the connection
fails and the driver keeps to the RPC.

A request is one of the three below: a refit bucket (``LoadBucket``), an adapter version to
hold (``LoadAdapter``: LoRA versions are written while streamed samples of other versions run,
so a rank takes them between two of its engine's steps) or one to free (``DropAdapter``).

Who may talk to a rank: a process of the same user (checked by the kernel's peer credentials,
on both ends) that proves it holds the key the driver made (``rollgen.auth.handshake``, within
``HANDSHAKE_TIMEOUT_S``). Anyone else is logged at WARNING and dropped; each connection is
authenticated in a thread of its own, so a client that connects and says nothing delays no one.
Requests and answers are pickles, read only from an authenticated peer. A request is answered in
order, one at a time; what the handler raises comes back: a ``RollgenError`` as itself, anything
else as a ``WorkerError`` with the rank's traceback. A channel that closes means the rank's
process ended; a rank that does not answer within the driver's deadline is wedged (both its
death, ``WorkerError(died=True)``).

A rank may run in a process of its own below the engine's actor (vLLM's engine core, its
workers): such a process outlives the actor's death for a moment (Ray ends a dead worker's
process group with SIGTERM, then SIGKILL 200 ms later), serving, then tearing the engine down.
So a server opened with its ``owner`` (the actor's pid) answers a request that meets a process
between it and the owner gone (before or after handling it) with that end, which the driver
raises as the rank's death too: never an update applied to, or failed by, an engine whose
actor died."""

from __future__ import annotations

import logging
import os
import pickle
import socket
import threading
import time
import traceback
import uuid
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any, NamedTuple

import torch

from rollgen import auth
from rollgen.errors import RollgenError, WorkerError
from rollgen.processes import lifeline, running
from rollgen.refit.bucket import WeightBucket
from rollgen.refit.layouts import KEPT_LAYOUTS, KeptLayouts

logger = logging.getLogger(__name__)

#: How long either end waits for the other to prove it holds the key (and the driver to connect).
HANDSHAKE_TIMEOUT_S = 10.0


class LoadBucket(NamedTuple):
    """Load a bucket of ``layout``: its pickle, or None for a layout the rank keeps
    (``rollgen.refit.receiver.Receiver.unpack``); answered False where it keeps none."""

    layout: str
    data: bytes | None


class LoadAdapter(NamedTuple):
    """Free adapter versions ``drop``, then hold the pickled adapter bucket ``data`` (the whole
    adapter, validated) as adapter ``version``; a bucket of a kept ``layout`` is unpacked once
    (``rollgen.refit.receiver.Receiver.unpack``)."""

    version: int
    data: bytes
    drop: tuple[int, ...] = ()
    layout: str = ""


class DropAdapter(NamedTuple):
    """Free adapter ``version``."""

    version: int


class ChannelServer:
    """One engine rank's end: a daemon thread that accepts connections and answers each
    authenticated one's requests with ``handle(request)`` (one request at a time), on ``device``
    and with as many CPU threads as the thread that opens it (a thread's CUDA device and thread
    count are its own). ``owner``: the pid of the process whose end ends the engine (its
    actor), where this process descends from it: requests that meet a process of that line
    gone are answered as the engine's end."""

    def __init__(
        self, handle: Callable[[Any], Any], authkey: bytes, device: torch.device, owner: int | None = None
    ) -> None:
        self.address = f"\0rollgen-channel-{uuid.uuid4().hex}"
        self._lifeline = () if owner is None else lifeline(owner)
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(self.address)
        self._listener.listen(16)
        self._handle, self._key, self._lock = handle, authkey, threading.Lock()
        self._device, self._threads = device, torch.get_num_threads()
        self._thread = threading.Thread(target=self._accept, daemon=True, name="rollgen-channel")
        self._thread.start()

    def _accept(self) -> None:
        with self._listener:  # a thread that fails closes its socket: the driver's connect fails
            self._bind_thread()
            while True:
                sock, _ = self._listener.accept()
                threading.Thread(
                    target=self._serve, args=(sock,), daemon=True, name="rollgen-channel"
                ).start()

    def _bind_thread(self) -> None:
        if torch.get_num_threads() != self._threads:
            torch.set_num_threads(self._threads)
        if self._device.type == "cuda":
            torch.cuda.set_device(self._device)

    def _serve(self, sock: socket.socket) -> None:
        try:
            _authenticate(sock, self._key, initiator=False)
        except auth.AuthenticationFailed as exc:
            logger.warning("refit channel %s: refused a connection: %s", self.address[1:], exc)
            sock.close()
            return
        self._bind_thread()
        with Connection(sock.detach()) as conn:
            while True:
                try:
                    request = pickle.loads(conn.recv_bytes())  # from the authenticated driver
                    with self._lock:
                        answer = self._answer(request)
                    conn.send_bytes(answer)
                except (EOFError, OSError):  # the driver closed its end
                    return

    def _answer(self, request: Any) -> bytes:
        """The answer to ``request``: the handler's outcome, unless a process of the owner's
        line is gone before or after it ran (then the engine's end, whatever the handler did)."""
        gone = self._ended()
        if gone is None:
            answer = _answer(self._handle, request)
            gone = self._ended()
            if gone is None:
                return answer
        return pickle.dumps(("ended", f"its engine's process {gone} ended"))

    def _ended(self) -> int | None:
        """The first process of the owner's line that is gone (None: all run)."""
        return next((pid for pid in self._lifeline if not running(pid)), None)


def _authenticate(sock: socket.socket, key: bytes, *, initiator: bool) -> None:
    """The peer is a process of this user that holds ``key`` (within the handshake's timeout);
    else ``AuthenticationFailed`` or ``OSError``, saying which."""
    uid = auth.peer_uid(sock)
    if uid != os.getuid():
        raise auth.AuthenticationFailed(f"the peer runs as user {uid}, not as this process's {os.getuid()}")
    sock.settimeout(HANDSHAKE_TIMEOUT_S)
    try:
        auth.handshake(sock, key, initiator=initiator)
    except TimeoutError as exc:
        raise auth.AuthenticationFailed(
            f"the peer did not authenticate within {HANDSHAKE_TIMEOUT_S} s"
        ) from exc
    except OSError as exc:
        raise auth.AuthenticationFailed(f"the handshake broke off ({exc})") from exc
    sock.settimeout(None)


def _answer(handle: Callable[[Any], Any], request: Any) -> bytes:
    """``handle(request)``'s outcome, pickled, as the driver reads it (``Channel.result``)."""
    try:
        outcome: tuple[Any, ...] = ("ok", handle(request))
    except RollgenError as exc:
        outcome = ("raised", exc)
    except Exception as exc:  # noqa: BLE001 - the rank's error goes to the driver, which raises it
        outcome = ("crashed", f"{type(exc).__name__}: {exc}", traceback.format_exc())
    try:
        return pickle.dumps(outcome)
    except (pickle.PicklingError, TypeError, AttributeError) as exc:  # an answer that cannot travel
        return pickle.dumps(("crashed", f"its answer cannot be pickled ({exc})", traceback.format_exc()))


class Channel:
    """The driver's end of one engine rank's channel; ``name`` names the rank in errors."""

    def __init__(self, address: str, authkey: bytes, name: str) -> None:
        self.name = name
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(HANDSHAKE_TIMEOUT_S)
            sock.connect(address)
            _authenticate(sock, authkey, initiator=True)
        except BaseException:
            sock.close()
            raise
        self._conn = Connection(sock.detach())

    def send(self, request: Any) -> None:
        """Send a request (``result`` takes its answer)."""
        try:
            self._conn.send_bytes(pickle.dumps(request))
        except OSError as exc:
            raise self._closed(exc) from None

    def result(self, timeout_s: float | None = None, deadline: float | None = None) -> Any:
        """The answer to the oldest request not yet answered: what the rank's handler returned.

        Args:
            timeout_s: how long the rank may take (None: no limit).
            deadline: the ``time.monotonic()`` the answer is due by, in place of ``timeout_s``
                from now (requests sent together share one).

        Raises:
            What the rank's handler raised; WorkerError: the channel closed, or (``died=True``) the
                rank did not answer within ``timeout_s`` (wedged: the channel closes, as its
                answers would come out of step)."""
        try:
            if deadline is None and timeout_s is not None:
                deadline = time.monotonic() + timeout_s
            if deadline is not None and not self._conn.poll(max(0.0, deadline - time.monotonic())):
                self.close()
                raise WorkerError(
                    self.name,
                    f"did not answer over its refit channel within call_timeout_s={timeout_s} s (wedged); "
                    "shut the generation down (which kills its engines) and create a new one",
                    died=True,
                )
            answer = pickle.loads(self._conn.recv_bytes())
        except (EOFError, OSError) as exc:
            raise self._closed(exc) from None
        if answer[0] == "ok":
            return answer[1]
        if answer[0] == "raised":
            raise answer[1]
        if answer[0] == "ended":
            self.close()
            raise self._ended(answer[1])
        raise WorkerError(self.name, f"raised {answer[1]}", answer[2])

    def close(self) -> None:
        self._conn.close()

    def _closed(self, exc: BaseException) -> WorkerError:
        return WorkerError(
            self.name,
            f"its refit channel closed ({type(exc).__name__}): the engine's process ended; the "
            "worker's log says why; create a new generation object",
            died=True,
        )

    def _ended(self, why: str) -> WorkerError:
        return WorkerError(
            self.name,
            f"{why} (the rank's answer over its refit channel); the worker's log says why; create a "
            "new generation object",
            died=True,
        )


def connect(addresses: list[list[str]], authkey: bytes, names: list[str]) -> list[list[Channel]]:
    """A channel to each rank (``addresses``: each engine's ranks'), or none where one does not
    connect (a rank on another machine, or in another network namespace: the threads of the
    ranks not reached wait on their sockets for as long as their engines run) or does not
    authenticate (logged at WARNING: refits then take the engines' RPC)."""
    channels: list[list[Channel]] = []
    try:
        for ranks, name in zip(addresses, names, strict=True):
            channels.append([])
            for rank, address in enumerate(ranks):
                channels[-1].append(Channel(address, authkey, f"{name} rank {rank}"))
    except auth.AuthenticationFailed as exc:  # someone else's socket, or a wrong key
        logger.warning(
            "refits go through the engines' RPC (about 30x a channel's round trip): a refit channel "
            "failed its authentication: %s",
            exc,
        )
        close(channels)
        return []
    except OSError as exc:  # a rank on another machine, or one whose thread ended
        logger.info("refits go through the engines' RPC: a refit channel did not connect (%s)", exc)
        close(channels)
        return []
    return channels


def close(channels: list[list[Channel]]) -> None:
    """Close every channel (each rank's thread ends)."""
    for ranks in channels:
        for channel in ranks:
            channel.close()


class EngineChannels:
    """The driver's channels to every rank of every engine (``channels[engine][rank]``), and the
    kept layouts each engine loaded over them, which later refits send by name alone: a mirror
    of each rank's ``KeptLayouts`` of ``capacity`` (the capacity the ranks were opened with)."""

    def __init__(self, channels: list[list[Channel]], capacity: int = KEPT_LAYOUTS) -> None:
        self.channels = channels
        self._held: list[KeptLayouts[str, None]] = [KeptLayouts(capacity) for _ in channels]

    def __bool__(self) -> bool:
        return bool(self.channels)

    def send(
        self,
        bucket: WeightBucket,
        pickled: Callable[[WeightBucket, int], bytes],
        timeout_s: float | None = None,
    ) -> None:
        """Have every engine rank load ``bucket``.

        Args:
            bucket: a validated bucket; a kept layout its engine holds goes by name alone.
            pickled: ``pickled(bucket, engine)``, what engine ``engine`` is sent otherwise (and a
                rank that no longer holds the layout gets next).
            timeout_s: how long each rank may take (``Channel.result``).

        Raises:
            WorkerError, or what a rank raised: once every rank answered (no rank still reads what
                the next refit writes), an engine's death first.

        A failure that leaves answers unread closes the channels (later refits go through the
        actors)."""
        layout = bucket.layout
        ranks = [(i, rank) for i, engine in enumerate(self.channels) for rank in engine]
        errors: list[RollgenError] = []
        requests = [
            (i, rank, LoadBucket(layout, None if layout in self._held[i] else pickled(bucket, i)))
            for i, rank in ranks
        ]
        answers = self._exchange(requests, timeout_s, errors)
        # a rank that dropped the layout (it keeps as many as its mirror here)
        missed = [(i, rank) for i, rank, answer in answers if not answer]
        if missed:
            requests = [(i, rank, LoadBucket(layout, pickled(bucket, i))) for i, rank in missed]
            self._exchange(requests, timeout_s, errors)
        _raise_first(errors)
        if layout:
            for held in self._held:  # the least recently used goes, as on the ranks
                held.keep(layout, None)

    def call(self, request: Callable[[int], Any], timeout_s: float | None = None) -> None:
        """Have every engine rank answer ``request(engine)`` (``LoadAdapter``, ``DropAdapter``),
        with the same deadline and errors as ``send``."""
        errors: list[RollgenError] = []
        requests = [(i, rank, request(i)) for i, engine in enumerate(self.channels) for rank in engine]
        self._exchange(requests, timeout_s, errors)
        _raise_first(errors)

    def _exchange(
        self,
        requests: list[tuple[int, Channel, Any]],
        timeout_s: float | None,
        errors: list[RollgenError],
    ) -> list[tuple[int, Channel, Any]]:
        """Send each request, then read each answer (engine, rank, answer) within ``timeout_s``
        of the sending (one deadline for every rank), adding to ``errors`` what ranks raised;
        answers left unread close every channel."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        sent, answers = [], []
        try:
            try:
                for i, rank, request in requests:
                    rank.send(request)
                    sent.append((i, rank))
            except RollgenError as exc:  # a closed channel: the ranks sent to still answer
                errors.append(exc)
            for i, rank in sent:
                try:
                    answers.append((i, rank, rank.result(timeout_s, deadline)))
                except RollgenError as exc:
                    errors.append(exc)
        except BaseException:  # answers left unread: these channels are out of step
            self.close()
            raise
        return answers

    def forget(self) -> None:
        """The engines let go of every kept layout (their mappings were released)."""
        for held in self._held:
            held.clear()

    def close(self) -> None:
        """Close every channel (each rank's thread ends); later refits go through the actors."""
        close(self.channels)
        self.channels = []


def _raise_first(errors: list[RollgenError]) -> None:
    """Raise an engine's death among ``errors`` first, else the first of them."""
    if errors:
        raise next((e for e in errors if isinstance(e, WorkerError) and e.died), errors[0])
