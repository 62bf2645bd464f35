"""Weight-sync groups: a refit broadcast from the trainer's sending rank to every engine rank.

A group is a process group of rollgen's own (not the trainer's default group, not the
engine's), built from a TCP store at the address and port the trainer gives: gloo on CPU,
NCCL on CUDA. The trainer's sending rank is rank 0 and hosts the store (``WeightSender``);
engine ranks are 1..N (every tensor-parallel rank of every data-parallel replica).

One update runs in three steps, on every rank at once:
1. the sender broadcasts a manifest: each bucket's tensor names, shapes, dtypes and offsets,
   whether the update is partial, and the sender's own rejection (NaN or infinite values);
2. every engine rank checks the manifest against the served model; if one rejects it, all
   ranks (the sender too) raise its ``RefitError`` and nothing was applied;
3. the sender broadcasts each bucket as one flat buffer (packing the next while the last is
   on the wire); each engine rank receives the next while it loads the last. A rank that fails
   to load keeps receiving (the broadcast needs every rank) and its error, marked ``stale``,
   reaches every rank at the end.
"""

from __future__ import annotations

import dataclasses
import logging
import pickle
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist

from rollgen.errors import RefitError, RollgenError
from rollgen.refit import (
    TensorMeta,
    WeightSpec,
    bucket_groups,
    check_against_spec,
    check_bucket_bytes,
    check_source,
    dtype_name,
    flat_offsets,
    flatten,
    named_tensors,
    nonfinite,
    unflatten,
)

logger = logging.getLogger(__name__)

SyncBackend = Literal["gloo", "nccl"]
Bucket = tuple[tuple[TensorMeta, ...], tuple[int, ...]]


@dataclass(frozen=True)
class SyncGroupSpec:
    """Where a weight-sync group meets: the sender (rank 0) hosts a TCP store at
    ``address:port``; ``world_size`` is 1 + the engine ranks."""

    address: str
    port: int
    world_size: int
    backend: SyncBackend = "gloo"
    #: How long a rank waits for the others (to join, or during a broadcast).
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.backend not in ("gloo", "nccl"):
            raise RefitError(f"weight-sync backend {self.backend!r}: use 'gloo' (CPU) or 'nccl' (CUDA)")
        if self.world_size < 2:
            raise RefitError(
                f"a weight-sync group has a sender and at least one engine rank, got {self.world_size}"
            )


@dataclass(frozen=True)
class Manifest:
    """What the sender broadcasts before any weight (step 1)."""

    buckets: tuple[Bucket, ...]
    partial: bool
    #: The sender's rejection of its own source; every rank raises it.
    error: RefitError | None = None


class SyncGroup:
    """One rank's end of a weight-sync group (joining blocks until every rank has joined). The
    sender passes the store it hosts; the other ranks connect to it."""

    def __init__(
        self,
        spec: SyncGroupSpec,
        rank: int,
        device: torch.device | None = None,
        store: dist.TCPStore | None = None,
    ) -> None:
        self.spec, self.rank = spec, rank
        timeout = timedelta(seconds=spec.timeout_s)
        if spec.backend == "gloo":
            device = torch.device("cpu")
        elif device is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self._store = store or open_store(spec, host=False)
        prefixed = dist.PrefixStore("rollgen-weight-sync", self._store)
        if spec.backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self.pg: Any = dist.ProcessGroupNCCL(prefixed, rank, spec.world_size, options)
        else:
            self.pg = dist.ProcessGroupGloo(prefixed, rank, spec.world_size, timeout)
        # a first collective: every rank has joined when the constructor returns
        self.highest(0)
        logger.debug("weight-sync rank %d of %d joined (%s)", rank, spec.world_size, spec.backend)

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
        self.pg.allreduce([t], options).wait()
        return int(t.item())

    def share(self, data: bytes | None, root: int) -> bytes:
        """``root``'s ``data`` on every rank."""
        size = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64, device=self.device)
        self.broadcast(size, root).wait()
        buf = torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)
        if data is not None:
            buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        self.broadcast(buf, root).wait()
        return buf.cpu().numpy().tobytes()

    def settle(self, error: RollgenError | None) -> None:
        """Every rank raises the error of the lowest rank that has one (none: return)."""
        worst = self.highest(self.spec.world_size - self.rank if error is not None else 0)
        if worst:
            root = self.spec.world_size - worst
            raise pickle.loads(self.share(pickle.dumps(error) if root == self.rank else None, root))


def open_store(spec: SyncGroupSpec, host: bool) -> dist.TCPStore:
    """The group's TCP store: hosted here (``host``; port 0: a free one), or connected to."""
    return dist.TCPStore(
        spec.address,
        spec.port,
        spec.world_size,
        is_master=host,
        timeout=timedelta(seconds=spec.timeout_s),
        wait_for_workers=False,
    )


class WeightSender:
    """The trainer's end of a weight-sync group: rank 0, the broadcasts' root. It hosts the
    group's TCP store at once (``spec.port`` 0: a free port); ``self.spec`` is the spec with
    the port, for the generation's ``init_weight_sync``. ``connect()`` (or the first ``send``)
    joins the group while ``init_weight_sync`` runs; both return once every rank has joined."""

    def __init__(self, spec: SyncGroupSpec, device: torch.device | None = None) -> None:
        self._store = open_store(spec, host=True)
        self.spec = dataclasses.replace(spec, port=self._store.port)
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
        """Broadcast ``source`` (a module or a state dict) to every engine rank, while the
        generation's ``update_weights_from_collective`` receives it. Arguments as ``refit``'s.
        RefitError if the source or the engines reject it (nothing applied), or if an engine
        failed while applying it (``stale``: the generation refuses to generate until a
        complete refit)."""
        groups: list[list[tuple[str, torch.Tensor]]] = []
        buckets: tuple[Bucket, ...] = ()
        try:
            check_source(source)
            check_bucket_bytes(bucket_bytes)
            groups = list(bucket_groups(source, bucket_bytes, dtype))
            buckets = tuple(_layout(g, dtype) for g in groups)
            error = _nonfinite_error(source, dtype) if check_finite else None
        except Exception as exc:  # noqa: BLE001 - sent to every rank in the manifest, raised below
            error = (
                exc
                if isinstance(exc, RefitError)
                else RefitError(f"the trainer could not prepare the update: {exc!r}")
            )
            groups, buckets = [], ()
        self.group.share(pickle.dumps(Manifest(buckets, partial, error)), root=0)
        if error is not None:
            raise error
        self.group.settle(None)  # the engines' checks of the manifest
        failure: RefitError | None = None
        # two send buffers of the largest bucket, reused: fresh host memory per bucket costs
        # more in page faults than the copy into it
        largest = max((offsets[-1] for _, offsets in buckets), default=0) + 1
        pool: list[torch.Tensor] = []
        in_flight: deque[tuple[Any, torch.Tensor]] = deque()
        for i, (group, (metas, offsets)) in enumerate(zip(groups, buckets)):
            buf = None
            if failure is None:
                try:  # the copy into the flat buffer casts
                    if len(pool) < 2:
                        pool.append(torch.empty(largest, dtype=torch.uint8, device=self.group.device))
                    buf = pool[i % 2][: offsets[-1] + 1]  # (its last byte: the mark)
                    flatten([t for _, t in group], metas, offsets, self.group.device, out=buf)
                    buf[-1] = 0
                except Exception as exc:  # noqa: BLE001 - every rank raises it at the end
                    logger.exception("weight-sync sender: packing bucket %d failed", i + 1)
                    failure = RefitError(
                        f"the trainer failed to pack bucket {i + 1} of {len(buckets)} ({exc!r}); the "
                        "engines may hold part of the update",
                        stale=True,
                    )
            if buf is None:  # the receivers expect every bucket: send it marked as not to load
                buf = torch.ones(offsets[-1] + 1, dtype=torch.uint8, device=self.group.device)
            in_flight.append((self.group.broadcast(buf), buf))
            if len(in_flight) > 1:  # at most two buckets beyond the model
                _finish(*in_flight.popleft())
        while in_flight:
            _finish(*in_flight.popleft())
        self.group.settle(failure)  # the engines' loads

    def close(self) -> None:
        """Leave the group (the engines' ends go with their generation)."""
        self._group = None


def receive(
    group: SyncGroup, spec: WeightSpec, load: Callable[[list[tuple[str, torch.Tensor]]], None]
) -> bool:
    """An engine rank's part of one update: check the manifest against ``spec``, then receive
    each bucket and ``load`` its named tensors (views of a receive buffer that the next buckets
    reuse: copy them). Returns whether the update was partial."""
    manifest: Manifest = pickle.loads(group.share(None, root=0))
    if manifest.error is not None:
        raise manifest.error
    buckets = manifest.buckets
    rejection = None
    try:
        check_against_spec((m for metas, _ in buckets for m in metas), spec, manifest.partial)
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

    failure: RollgenError | None = None
    incoming = [post(0)] if buckets else []
    for i, (metas, offsets) in enumerate(buckets):
        work, buf = incoming.pop()
        work.wait()
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
    return manifest.partial


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


def _finish(work: Any, buf: torch.Tensor) -> None:
    """Wait for a broadcast to leave this process (the buffer may then be freed)."""
    work.wait()
    if buf.is_cuda:
        torch.cuda.current_stream(buf.device).synchronize()
