"""Weight-sync groups: a refit broadcast from the trainer's sending rank to every engine rank.

A group is a process group of rollgen's own (not the trainer's default group, not the
engine's), built from a TCP store at the address and port the trainer gives: gloo on CPU,
NCCL on CUDA. The trainer's sending rank is rank 0 and hosts the store (``WeightSender``);
engine ranks are 1..N (every tensor-parallel rank of every data-parallel replica).

Who is a member: a rank that holds the spec's secret. Before anything else crosses the group,
every rank proves it does (a tag over fresh nonces of every rank); manifests and errors travel
as JSON data, each with a tag over its place in the group's sequence, so a non-member can
neither read the weights' layout nor forge a message, and nothing is unpickled. The weights
themselves cross gloo or NCCL in plaintext, unauthenticated: the group's address belongs on a
network only the trainer and the engines reach.

One update runs in three steps, on every rank at once:
1. the sender broadcasts a manifest: each bucket's tensor names, shapes and dtypes, whether
   the update is partial, and the sender's own rejection (NaN or infinite values);
2. every engine rank checks the manifest against the served model; if one rejects it, all
   ranks (the sender too) raise its ``RefitError`` and nothing was applied;
3. the sender broadcasts each bucket as one flat buffer (packing the next while the last is
   on the wire); each engine rank receives the next while it loads the last. A rank that fails
   to load keeps receiving (the broadcast needs every rank) and its error, marked ``stale``,
   reaches every rank at the end.
A collective that fails (a rank gone, a timeout) breaks the group: a ``RefitError``, ``stale``
only when it came during step 3.
"""

from __future__ import annotations

import contextlib
import dataclasses
import ipaddress
import json
import logging
import math
import socket
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist

from rollgen import auth
from rollgen.errors import RefitError, _rebuild
from rollgen.refit.bucket import bucket_groups, named_tensors
from rollgen.refit.checks import check_against_spec, nonfinite
from rollgen.refit.meta import TensorMeta, WeightSpec, dtype_name, flat_offsets, flatten, unflatten

logger = logging.getLogger(__name__)

SyncBackend = Literal["gloo", "nccl"]
Bucket = tuple[tuple[TensorMeta, ...], tuple[int, ...]]

#: The most a manifest or an error message may take on the wire (a rank allocates no more).
MAX_MESSAGE_BYTES = 64 << 20
_PREFIX = "rollgen-weight-sync"


@dataclass(frozen=True)
class SyncGroupSpec:
    """Where a weight-sync group meets, and the secret that makes a rank a member.

    Args:
        address, port: where the sender (rank 0) hosts the group's TCP store, listening on that
            address only (port 0: a free one).
        world_size: 1 + the engine ranks.
        backend: "gloo" (CPU) or "nccl" (CUDA).
        secret: fresh for each spec unless given.

    Raises:
        RefitError: listing every invalid field.

    Every rank proves it holds the secret before anything is sent, and every manifest and error
    carries its tag. Hand the spec itself on (the trainer's process to the generation's): never
    the secret over the group's own network in the clear."""

    address: str
    port: int
    world_size: int
    backend: SyncBackend = "gloo"
    #: How long a rank waits for the others during a broadcast.
    timeout_s: float = 600.0
    secret: str = field(default_factory=auth.new_secret, repr=False)
    #: How long a rank waits for every rank to join and authenticate (None: the lesser of 60 s
    #: and ``timeout_s``): a rank that never comes, or a process without the secret in a rank's
    #: slot, fails the join within it, not within ``timeout_s``.
    join_timeout_s: float | None = None

    def __post_init__(self) -> None:
        problems = []
        if self.backend not in ("gloo", "nccl"):
            problems.append(f"backend {self.backend!r}: use 'gloo' (CPU) or 'nccl' (CUDA)")
        if not isinstance(self.world_size, int) or self.world_size < 2:
            problems.append(
                f"world_size {self.world_size!r}: a group has a sender and at least one engine rank (>= 2)"
            )
        if not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            problems.append(f"port {self.port!r}: an integer in [0, 65535] (0: a free one)")
        if (
            not isinstance(self.timeout_s, (int, float))
            or not math.isfinite(self.timeout_s)
            or self.timeout_s <= 0
        ):
            problems.append(f"timeout_s {self.timeout_s!r}: a finite number of seconds > 0")
        elif self.join_timeout_s is not None and not (
            isinstance(self.join_timeout_s, (int, float))
            and math.isfinite(self.join_timeout_s)
            and 0 < self.join_timeout_s <= self.timeout_s
        ):
            problems.append(
                f"join_timeout_s {self.join_timeout_s!r}: a finite number of seconds > 0, at most "
                f"timeout_s ({self.timeout_s}), or None"
            )
        if not isinstance(self.address, str) or not self.address:
            problems.append(f"address {self.address!r}: the sender's host name or IP address")
        if not isinstance(self.secret, str) or len(self.secret) < 32:
            problems.append("secret: at least 32 characters (leave it out: each spec makes a fresh one)")
        if problems:
            raise RefitError("invalid weight-sync group spec", problems)

    @property
    def where(self) -> str:
        return f"{self.address}:{self.port}"

    @property
    def join_deadline_s(self) -> float:
        """How long a rank waits for the others to join and authenticate."""
        return min(60.0, self.timeout_s) if self.join_timeout_s is None else self.join_timeout_s


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
            raise _error_from(self.share(_error_data(error) if root == self.rank else None, root))


def _error_data(error: RefitError | None) -> dict[str, Any]:
    assert error is not None  # only the rank whose error it is sends it
    return {"message": str(error), "problems": error.problems, "stale": error.stale}


def _error_from(data: Any) -> RefitError:
    """The ``RefitError`` another rank sent (as data: the only type that crosses the group)."""
    try:
        message, problems, stale = (
            str(data["message"]),
            [str(p) for p in data["problems"]],
            bool(data["stale"]),
        )
    except (TypeError, KeyError) as exc:
        return RefitError(f"a weight-sync rank sent an error this rank cannot read ({exc!r})", stale=True)
    return _rebuild(RefitError, message, {"problems": problems, "stale": stale})  # type: ignore[return-value]


def _manifest_data(buckets: tuple[Bucket, ...], partial: bool, error: RefitError | None) -> dict[str, Any]:
    return {
        "buckets": [[[m.name, list(m.shape), m.dtype] for m in metas] for metas, _ in buckets],
        "partial": partial,
        "error": None if error is None else _error_data(error),
    }


def _manifest_from(data: Any) -> tuple[tuple[Bucket, ...], bool]:
    """The buckets and partiality of a manifest (its sender's error raised)."""
    if data["error"] is not None:
        raise _error_from(data["error"])
    buckets = []
    for bucket in data["buckets"]:
        metas = tuple(TensorMeta(str(n), tuple(int(d) for d in shape), str(dt)) for n, shape, dt in bucket)
        unknown = [m.dtype for m in metas if not isinstance(getattr(torch, m.dtype, None), torch.dtype)]
        if unknown:
            raise RefitError(f"the sender's manifest names dtypes torch does not have: {unknown}")
        buckets.append((metas, flat_offsets(m.nbytes for m in metas)))  # (checked against the spec first)
    return tuple(buckets), bool(data["partial"])


def _record(spec: SyncGroupSpec) -> bytes:
    return json.dumps({"world_size": spec.world_size}).encode()


def _publish_record(store: dist.TCPStore, spec: SyncGroupSpec) -> None:
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


class WeightSender:
    """The trainer's end of a weight-sync group: rank 0, the broadcasts' root.

    Args:
        spec: the generation's ``weight_sync_spec``.
        device: the GPU an NCCL group sends from (None: the current CUDA device); gloo sends
            from host memory.

    Raises:
        RefitError: the group's store cannot be hosted at the spec's address and port.

    It hosts the group's TCP store at once (``spec.port`` 0: a free port); ``self.spec`` is the
    spec with the port, for the generation's ``init_weight_sync``. ``connect()`` (or the first
    ``send``) joins the group while ``init_weight_sync`` runs; both return once every rank has
    joined."""

    def __init__(self, spec: SyncGroupSpec, device: torch.device | None = None) -> None:
        self._store = open_store(spec, host=True)
        self.spec = dataclasses.replace(spec, port=self._store.port)
        _publish_record(self._store, self.spec)
        self._device = device
        self._group: SyncGroup | None = None

    def connect(self) -> None:
        """Join the group (returns once every engine rank has joined)."""
        if self._group is None:
            self._group = SyncGroup(self.spec, 0, self._device, store=self._store)

    @property
    def group(self) -> SyncGroup:
        self.connect()
        assert self._group is not None  # set by connect
        return self._group

    def send(
        self,
        source: torch.nn.Module | Mapping[str, torch.Tensor],
        *,
        bucket_bytes: int | None = None,
        dtype: torch.dtype | None = None,
        partial: bool = False,
        check_finite: bool = True,
    ) -> None:
        """Broadcast ``source`` to every engine rank, while the generation's
        ``update_weights_from_collective`` receives it.

        Args:
            source: a module or a state dict.
            bucket_bytes, dtype, partial, check_finite: as the generation's ``refit``'s.

        Raises:
            RefitError: the source or the engines reject it (nothing applied), or an engine failed
                while applying it (``stale``: the generation refuses to generate until a complete
                refit); a group that broke earlier."""
        group = self.group
        group.check_usable()
        groups: list[list[tuple[str, torch.Tensor]]] = []
        buckets: tuple[Bucket, ...] = ()
        try:
            groups = list(bucket_groups(source, bucket_bytes, dtype))  # checks the arguments first
            buckets = tuple(_layout(g, dtype) for g in groups)
            error = _nonfinite_error(source, dtype) if check_finite else None
        except Exception as exc:  # noqa: BLE001 - sent to every rank in the manifest, raised below
            error = (
                exc
                if isinstance(exc, RefitError)
                else RefitError(f"the trainer could not prepare the update: {exc!r}")
            )
            groups, buckets = [], ()
        group.share(_manifest_data(buckets, partial, error), root=0)
        if error is not None:
            raise error
        group.settle(None)  # the engines' checks of the manifest
        with group.applying():
            self._send_buckets(group, groups, buckets)

    def _send_buckets(
        self, group: SyncGroup, groups: list[list[tuple[str, torch.Tensor]]], buckets: tuple[Bucket, ...]
    ) -> None:
        failure: RefitError | None = None
        # two send buffers of the largest bucket, reused: fresh host memory per bucket costs
        # more in page faults than the copy into it
        largest = max((offsets[-1] for _, offsets in buckets), default=0) + 1
        pool: list[torch.Tensor] = []
        in_flight: deque[tuple[Any, torch.Tensor]] = deque()
        for i, (named, (metas, offsets)) in enumerate(zip(groups, buckets)):
            buf = None
            if failure is None:
                try:  # the copy into the flat buffer casts
                    if len(pool) < 2:
                        pool.append(torch.empty(largest, dtype=torch.uint8, device=group.device))
                    buf = pool[i % 2][: offsets[-1] + 1]  # (its last byte: the mark)
                    flatten([t for _, t in named], metas, offsets, group.device, out=buf)
                    buf[-1] = 0
                except Exception as exc:  # noqa: BLE001 - every rank raises it at the end
                    logger.exception("weight-sync sender: packing bucket %d failed", i + 1)
                    failure = RefitError(
                        f"the trainer failed to pack bucket {i + 1} of {len(buckets)} ({exc!r}); the "
                        "engines may hold part of the update",
                        stale=True,
                    )
            if buf is None:  # the receivers expect every bucket: send it marked as not to load
                buf = torch.ones(offsets[-1] + 1, dtype=torch.uint8, device=group.device)
            in_flight.append((group.broadcast(buf), buf))
            if len(in_flight) > 1:  # at most two buckets beyond the model
                _finish(group, *in_flight.popleft())
        while in_flight:
            _finish(group, *in_flight.popleft())
        group.settle(failure)  # the engines' loads

    def close(self) -> None:
        """Leave the group (the engines' ends go with their generation)."""
        self._group = None


def receive(
    group: SyncGroup, spec: WeightSpec, load: Callable[[list[tuple[str, torch.Tensor]]], None]
) -> bool:
    """An engine rank's part of one update; returns whether the update was partial.

    Args:
        group: this rank's end of the group.
        spec: the served model's, which the update's manifest is checked against first.
        load: takes each bucket's named tensors (views of a receive buffer that the next
            buckets reuse: copy them).

    Raises:
        RefitError: the update rejected by any rank (nothing applied), a load or the group that
            failed while applying (``stale``), a group that broke earlier."""
    group.check_usable()
    buckets, partial = _manifest_from(group.share(None, root=0))
    rejection = None
    try:
        check_against_spec((m for metas, _ in buckets for m in metas), spec, partial)
        # two receive buffers of the largest bucket (and its mark), taken before anything is
        # applied: a rank that cannot hold them rejects the update
        largest = max((offsets[-1] for _, offsets in buckets), default=0) + 1
        pool = [torch.empty(largest, dtype=torch.uint8, device=group.device) for _ in buckets[:2]]
    except RefitError as exc:
        rejection = exc
    except torch.OutOfMemoryError as exc:
        rejection = RefitError(
            f"engine rank {group.rank} cannot hold two buckets of {largest} bytes ({exc}); nothing "
            "was applied: send smaller buckets (bucket_bytes)"
        )
    group.settle(rejection)

    def post(i: int) -> tuple[Any, torch.Tensor]:
        buf = pool[i % 2][: buckets[i][1][-1] + 1]
        return group.broadcast(buf), buf

    with group.applying():
        _receive_buckets(group, buckets, post, load)
    return partial


def _receive_buckets(
    group: SyncGroup,
    buckets: tuple[Bucket, ...],
    post: Callable[[int], tuple[Any, torch.Tensor]],
    load: Callable[[list[tuple[str, torch.Tensor]]], None],
) -> None:
    failure: RefitError | None = None
    incoming = [post(0)] if buckets else []
    for i, (metas, offsets) in enumerate(buckets):
        work, buf = incoming.pop()
        group.wait(work, f"receiving bucket {i + 1} of {len(buckets)}")
        if i + 1 < len(buckets):
            incoming.append(post(i + 1))
        if failure is not None or int(buf[-1].item()) != 0:
            continue  # keep receiving (the sender's broadcasts need every rank); skip marked ones
        try:
            load([(m.name, t) for m, t in zip(metas, unflatten(buf, metas, offsets))])
        except Exception as exc:  # noqa: BLE001 - re-raised on every rank below, as a RefitError
            logger.exception("weight-sync rank %d: loading bucket %d failed", group.rank, i + 1)
            failure = RefitError(
                f"engine rank {group.rank} failed to load bucket {i + 1} of {len(buckets)} "
                f"({type(exc).__name__}: {exc}); replicas may now hold different weights",
                stale=True,
            )
    group.settle(failure)


def _layout(group: list[tuple[str, torch.Tensor]], dtype: torch.dtype | None) -> Bucket:
    metas = tuple(TensorMeta(n, tuple(t.shape), dtype_name(dtype or t.dtype)) for n, t in group)
    return metas, flat_offsets(m.nbytes for m in metas)


def _nonfinite_error(
    source: torch.nn.Module | Mapping[str, torch.Tensor], dtype: torch.dtype | None
) -> RefitError | None:
    """The source's tensors holding NaN or infinite values (also after a cast to ``dtype``
    narrower than theirs)."""
    named = list(named_tensors(source))
    bad = nonfinite(named)
    if dtype is not None and dtype.is_floating_point:
        limit = torch.finfo(dtype).max
        bad += [
            n
            for n, t in named
            if n not in bad and t.is_floating_point() and t.numel() and t.abs().max().item() > limit
        ]
    if not bad:
        return None
    return RefitError(
        f"weight update rejected: {len(bad)} tensor(s) hold NaN or infinite values (or overflow the "
        "cast); nothing of them was applied (check the trainer's step; check_finite=False skips this)",
        bad,
    )


def _finish(group: SyncGroup, work: Any, buf: torch.Tensor) -> None:
    """Wait for a broadcast to leave this process (the buffer may then be freed)."""
    group.wait(work, "sending a bucket")
    if buf.is_cuda:
        torch.cuda.current_stream(buf.device).synchronize()
