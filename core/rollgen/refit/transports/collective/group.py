"""One rank's end of a weight-sync group: joining it (the TCP store the sender hosts, the
group's record there, every rank's arrival), proving every rank holds the spec's secret, and the
collectives an update runs on (broadcasts, tagged messages, every rank's outcome)."""

from __future__ import annotations

import contextlib
import ipaddress
import json
import logging
import socket
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from rollgen import auth
from rollgen.errors import RefitError
from rollgen.refit.transports.collective.spec import SyncGroupSpec
from rollgen.refit.transports.collective.wire import MAX_MESSAGE_BYTES, error_data, error_from

logger = logging.getLogger(__name__)

_PREFIX = "rollgen-weight-sync"


class SyncGroup:
    """One rank's end of a weight-sync group (joining blocks until every rank has joined and
    proved it holds the spec's secret). The sender passes the store it hosts; the other ranks
    connect to it. Every failure of the group is a ``RefitError``; a group that failed once
    (a timeout, a rank gone, a message that failed its check) is broken for good."""

    def __init__(
        self,
        spec: SyncGroupSpec,
        rank: int,
        device: torch.device | None = None,
        store: dist.TCPStore | None = None,
    ) -> None:
        self.spec, self.rank = spec, rank
        self._key = spec.secret.encode()
        self._sent = 0  # messages shared so far: each message's tag covers its number
        self._applying = False  # between an update's manifest and its end: failures are stale
        self.broken: str | None = None
        if spec.backend == "gloo":
            device = torch.device("cpu")
        elif device is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        try:
            self._store = store or open_store(spec, host=False)
            if rank != 0:
                _check_record(self._store, spec)
            _await_ranks(self._store, spec, rank)
            prefixed = dist.PrefixStore(_PREFIX, self._store)
            timeout = timedelta(seconds=spec.timeout_s)
            if spec.backend == "nccl":
                options = dist.ProcessGroupNCCL.Options()
                options._timeout = timeout
                self.pg: Any = dist.ProcessGroupNCCL(prefixed, rank, spec.world_size, options)
            else:
                gloo = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
                gloo._timeout = timeout
                gloo._devices = [_gloo_device(spec, rank)]
                self.pg = dist.ProcessGroupGloo(prefixed, rank, spec.world_size, gloo)
        except (RuntimeError, OSError) as exc:  # torch's DistError and gloo's errors are RuntimeErrors
            raise RefitError(
                f"weight-sync rank {rank} could not join the group at {spec.where} "
                f"({type(exc).__name__}: {exc}). "
                + (
                    "Call the generation's init_weight_sync(sender.spec) while connect() runs"
                    if rank == 0
                    else "Is the trainer's WeightSender up, at that address, with this spec?"
                )
            ) from None
        self._authenticate()
        logger.debug("weight-sync rank %d of %d joined (%s)", rank, spec.world_size, spec.backend)

    def _authenticate(self) -> None:
        """Every rank proves it holds the secret: a tag over its rank and every rank's fresh
        nonce (no tag from an earlier group replays). Nothing else is sent before this passes."""
        world = str(self.spec.world_size).encode()
        nonces = b"".join(self._allgather(auth.nonce(), self.spec.join_deadline_s))
        tags = self._allgather(
            auth.tag(self._key, b"rank", str(self.rank).encode(), world, nonces), self.spec.join_deadline_s
        )
        strangers = [
            r
            for r, t in enumerate(tags)
            if r != self.rank and not auth.verify(self._key, (b"rank", str(r).encode(), world, nonces), t)
        ]
        if strangers:
            self.broken = f"rank(s) {strangers} did not authenticate"
            raise RefitError(
                f"weight-sync rank(s) {strangers} did not prove they hold the group's secret: a process "
                f"other than the trainer's and the engines' joined the group at {self.spec.where}, or the "
                "ranks were given different specs. Nothing was sent. Put the group's address on a network "
                "only the trainer and the engines reach, and make a new group (a WeightSender and "
                "init_weight_sync)"
            )

    def _allgather(self, data: bytes, within_s: float) -> list[bytes]:
        """Every rank's ``data`` (all of one length) on every rank, within ``within_s``."""
        mine = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device)
        out = [torch.empty_like(mine) for _ in range(self.spec.world_size)]
        what = (
            "the ranks authenticated: a rank that joined did not take part (a process without the secret "
            "may hold its slot)"
        )
        self.wait(self.pg.allgather([out], [mine]), what, within_s)
        return [t.cpu().numpy().tobytes() for t in out]

    def wait(self, work: Any, what: str, within_s: float | None = None) -> None:
        """Wait for a collective (``work``) at most ``within_s`` (None: the spec's timeout_s),
        ``what`` naming it in the error.

        Raises:
            RefitError: the collective failed, which breaks the group (``stale`` while an update
                is being applied)."""
        try:
            if within_s is None:  # the group's own timeout (NCCL: the stream waits, not this thread)
                work.wait()
            else:
                work.wait(timedelta(seconds=within_s))
        except RuntimeError as exc:
            self.broken = f"{type(exc).__name__}: {exc}"
            raise RefitError(
                f"weight-sync rank {self.rank}: the group at {self.spec.where} broke while {what} "
                f"(within {within_s or self.spec.timeout_s} s every rank must take part: {self.broken}); "
                + (
                    "the engines may hold part of the update. "
                    if self._applying
                    else "nothing of this update was applied. "
                )
                + "Make a new group (a WeightSender and init_weight_sync)",
                stale=self._applying,
            ) from None

    @contextlib.contextmanager
    def applying(self) -> Iterator[None]:
        """While an update's buckets flow: a failure of the group leaves the engines stale."""
        self._applying = True
        try:
            yield
        finally:
            self._applying = False

    def check_usable(self) -> None:
        """Raises RefitError if the group broke earlier (make a new one)."""
        if self.broken is not None:
            raise RefitError(
                f"the weight-sync group at {self.spec.where} broke earlier ({self.broken}): make a new one "
                "(a WeightSender and init_weight_sync)"
            )

    def broadcast(self, tensor: torch.Tensor, root: int = 0) -> Any:
        """Start a broadcast of ``tensor`` from ``root``; returns its work handle."""
        options = dist.BroadcastOptions()
        options.rootRank = root
        return self.pg.broadcast([tensor], options)

    def highest(self, value: int) -> int:
        """The highest ``value`` any rank passes."""
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp(dist.ReduceOp.MAX)
        self.wait(self.pg.allreduce([t], options), "the ranks compared outcomes")
        return int(t.item())

    def share(self, message: Any, root: int) -> Any:
        """``root``'s ``message`` (JSON data) on every rank, with a tag over it, its root and its
        number in the group's sequence: a message no member sent fails here, before it is read."""
        self._sent += 1
        parts = (b"message", str(self._sent).encode(), str(root).encode())
        data = None
        if root == self.rank:
            body = json.dumps(message).encode()
            data = body + auth.tag(self._key, *parts, body)
        size = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64, device=self.device)
        self.wait(self.broadcast(size, root), "sharing a message")
        n = int(size.item())
        if not auth.TAG_BYTES <= n <= MAX_MESSAGE_BYTES + auth.TAG_BYTES:
            self.broken = f"a message of {n} bytes from rank {root}"
            raise RefitError(
                f"weight-sync rank {self.rank}: rank {root} sent a message of {n} bytes; refused"
            )
        buf = torch.empty(n, dtype=torch.uint8, device=self.device)
        if data is not None:
            buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        self.wait(self.broadcast(buf, root), "sharing a message")
        raw = buf.cpu().numpy().tobytes()
        body, mac = raw[: -auth.TAG_BYTES], raw[-auth.TAG_BYTES :]
        if not auth.verify(self._key, (*parts, body), mac):
            self.broken = f"a message from rank {root} failed its check"
            raise RefitError(
                f"weight-sync rank {self.rank}: a message from rank {root} failed its authentication (a "
                "non-member on the group's network, or ranks out of step after an earlier failure); "
                "nothing of it was read. Make a new group (a WeightSender and init_weight_sync)"
            )
        return json.loads(body)

    def settle(self, error: RefitError | None) -> None:
        """Every rank raises the error of the lowest rank that has one (none: return)."""
        worst = self.highest(self.spec.world_size - self.rank if error is not None else 0)
        if worst:
            root = self.spec.world_size - worst
            raise error_from(self.share(error_data(error) if root == self.rank else None, root))


def _record(spec: SyncGroupSpec) -> bytes:
    return json.dumps({"world_size": spec.world_size}).encode()


def publish_record(store: dist.TCPStore, spec: SyncGroupSpec) -> None:
    """What a joining rank checks first: the group's size, tagged with its secret."""
    record = _record(spec)
    store.set(f"{_PREFIX}/group", record + auth.tag(spec.secret.encode(), b"group", record))  # type: ignore[arg-type]


def _check_record(store: dist.TCPStore, spec: SyncGroupSpec) -> None:
    """The store is the sender's for this spec, for as many ranks: a mismatch fails here at
    once, before any rank waits on another."""
    stored = store.get(f"{_PREFIX}/group")
    theirs, mac = stored[: -auth.TAG_BYTES], stored[-auth.TAG_BYTES :]
    if not auth.verify(spec.secret.encode(), (b"group", theirs), mac):
        raise RefitError(
            f"the record of the weight-sync store at {spec.where} failed its check against this spec's "
            "secret: the store there is not this spec's sender's (another sender, or a process without "
            "the secret, listens there or wrote it). Pass the sender's own spec "
            "(rollgen.WeightSender(spec).spec) to init_weight_sync, on a network only the trainer and "
            "the engines reach"
        )
    if theirs != _record(spec):
        raise RefitError(
            f"the weight-sync group at {spec.where} has {json.loads(theirs)['world_size']} ranks, this "
            f"spec {spec.world_size}: make one spec with the generation's weight_sync_spec"
        )


def _await_ranks(store: dist.TCPStore, spec: SyncGroupSpec, rank: int) -> None:
    """Say this rank has come, and wait within the join deadline for every rank to say so.

    Raises:
        RefitError: naming the ranks that did not come (the store is not authenticated: what it
            says is what the ranks, or anyone reaching it, wrote)."""
    keys = [f"{_PREFIX}/joined/{r}" for r in range(spec.world_size)]
    store.set(keys[rank], b"1")  # type: ignore[arg-type]
    try:
        store.wait(keys, timedelta(seconds=spec.join_deadline_s))
    except RuntimeError:  # torch's DistStoreError: the wait timed out
        missing = [r for r, key in enumerate(keys) if not store.check([key])]
        raise RefitError(
            f"weight-sync rank {rank}: rank(s) {missing} of {spec.world_size} did not join the group at "
            f"{spec.where} within its join deadline "
            f"({spec.join_deadline_s} s; SyncGroupSpec.join_timeout_s). "
            + (
                "Call the generation's init_weight_sync(sender.spec) while connect() runs, with every "
                "engine up"
                if rank == 0
                else "Is the trainer's WeightSender connecting, and every engine rank up?"
            )
        ) from None


def _gloo_device(spec: SyncGroupSpec, rank: int) -> Any:
    """Where a gloo rank listens: the spec's address for the sender, and for every rank of a
    group on this host's loopback; elsewhere gloo's default (the host name's address)."""
    if rank == 0 or _is_loopback(spec.address):
        return dist.ProcessGroupGloo.create_device(hostname=spec.address)
    return dist.ProcessGroupGloo.create_default_device()


def _is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return address == "localhost"


def open_store(spec: SyncGroupSpec, host: bool) -> dist.TCPStore:
    """The group's TCP store: hosted here (``host``; port 0: a free one), listening on the
    spec's address alone; or connected to.

    Raises:
        RefitError: the store cannot be hosted at the spec's address and port."""
    fd = None
    if host:
        try:
            family = socket.getaddrinfo(spec.address, spec.port, type=socket.SOCK_STREAM)[0][0]
            server = socket.create_server((spec.address, spec.port), family=family)
        except OSError as exc:
            raise RefitError(
                f"cannot host the weight-sync group's store at {spec.where} ({exc}): give an address of this "
                "machine and a free port (port 0: one is picked)"
            ) from None
        port = server.getsockname()[1]
        fd = server.detach()  # the store's now
    else:
        port = spec.port
    return dist.TCPStore(
        spec.address,
        port,
        spec.world_size,
        is_master=host,
        timeout=timedelta(seconds=spec.join_deadline_s),  # the store serves the join only
        wait_for_workers=False,
        master_listen_fd=fd,
    )
