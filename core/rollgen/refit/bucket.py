"""Buckets: a bounded group of named tensors packed for one transport (``tensors``,
``shared_memory``, ``cuda_ipc``: ``rollgen.refit.transports``), the trainer's packing of a source
into them, their sizes, and the merge of colocated trainer ranks' CUDA IPC buckets."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from rollgen.errors import RefitError
from rollgen.refit.checks import (
    check_bucket_bytes,
    check_dtype,
    check_readable,
    check_source,
    require_finite,
)
from rollgen.refit.meta import TensorMeta, Transport, flat_offsets, flatten, module_group, unflatten
from rollgen.refit.transports import BucketTransport, transport_named
from rollgen.refit.transports.cuda_ipc import InPlaceViews, IpcHandle

#: Bucket size for a source in host memory.
DEFAULT_BUCKET_BYTES = 1 << 30


#: Bounds of the bucket size for a source on a GPU (a quarter of its free memory): fewer, larger
#: buckets refit faster (BENCHMARKS.md, the refit by bucket size).
GPU_BUCKET_BYTES = (64 << 20, 4 << 30)


@dataclass
class WeightBucket:
    """A bounded group of named tensors, packed for one transport (``via``). Picklable."""

    transport: Transport
    metas: tuple[TensorMeta, ...]
    payload: Any
    #: Byte offset of each tensor in the flat buffer (``shared_memory`` and ``cuda_ipc``).
    offsets: tuple[int, ...] = ()
    #: Names a layout kept between refits (``rollgen.refit.staging``, ``rollgen.refit.in_place``): the payload
    #: names the GPUs, each receiver gets its own handles (``for_receiver``) and keeps what it
    #: unpacked under this name, so later refits of the layout send only the name. Empty: a
    #: bucket of its own.
    layout: str = ""
    #: What the sender keeps alive while receivers read it (or a receiver mapped: ``resolve``).
    held: list[torch.Tensor] = field(default_factory=list, repr=False, compare=False)

    @property
    def via(self) -> BucketTransport:
        """The transport, both its ends (``rollgen.refit.transports``).

        Raises:
            RefitError: for an unknown transport."""
        return transport_named(self.transport)

    def __getstate__(self) -> dict[str, Any]:
        return {
            "transport": self.transport,
            "metas": self.metas,
            "payload": self.via.pickled_payload(self),  # one pickle per receiver where it must be
            "offsets": self.offsets,
            "layout": self.layout,
        }

    def for_receiver(self, payload: Mapping[str, IpcHandle | InPlaceViews]) -> WeightBucket:
        """This kept layout's bucket as one receiver gets it: with its own ``payload`` of handles."""
        return WeightBucket(self.transport, self.metas, payload, self.offsets, self.layout)

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, held=[])

    def resolve(self) -> WeightBucket:
        """Map a received bucket into this process (a shared-memory handle opens once), so it
        can be unpacked here and re-sent onwards with a fresh handle. Returns self."""
        self.via.resolve(self)
        return self

    def unpack(self, device: torch.device | str | None = None) -> list[tuple[str, torch.Tensor]]:
        """The named tensors, on the engine side.

        Args:
            device: for ``cuda_ipc``, the GPU to map them on (None: this process's device).

        Raises:
            RefitError: for an unknown transport, or (``cuda_ipc``) no handle for the GPU."""
        tensors = self.via.unpack(self, device)
        return [(m.name, t) for m, t in zip(self.metas, tensors, strict=True)]

    def copied(self) -> FlatCopy:
        """The tensors copied into one buffer of their own (one fused copy), in the process
        that packed this bucket (where they are: a GPU bucket's on its GPU) or received it (in
        host memory: the GPU is the sender's)."""
        offsets = flat_offsets(m.nbytes for m in self.metas)
        if not self.metas:
            return FlatCopy(self.metas, offsets, None)
        if self.held and self.offsets == offsets:  # its flat buffer is here: one copy of its bytes
            return FlatCopy(self.metas, offsets, self.held[0][: offsets[-1]].clone())
        tensors = self.via.local(self)
        device = tensors[0].device if self.held else torch.device("cpu")
        return FlatCopy(self.metas, offsets, flatten(tensors, self.metas, offsets, device))


@dataclass(frozen=True)
class FlatCopy:
    """Named tensors in one buffer of their own (``WeightBucket.copied``), laid out as they
    are read (``named``)."""

    metas: tuple[TensorMeta, ...]
    offsets: tuple[int, ...]
    flat: torch.Tensor | None

    def named(self) -> list[tuple[str, torch.Tensor]]:
        """The tensors: views of the one buffer."""
        if self.flat is None:
            return []
        views = unflatten(self.flat, self.metas, self.offsets)
        return [(m.name, t) for m, t in zip(self.metas, views, strict=True)]


def as_buckets(buckets: Any) -> list[WeightBucket]:
    """``update_weights``'s buckets as a list.

    Raises:
        RefitError: unless ``buckets`` is one ``WeightBucket`` or several, each of a known
            transport."""
    if buckets is None or isinstance(buckets, (str, bytes, Mapping, torch.Tensor)):
        raise RefitError(f"update_weights takes a WeightBucket or several, got {type(buckets).__name__}")
    items = [buckets] if isinstance(buckets, WeightBucket) else list(buckets)
    for b in items:
        if not isinstance(b, WeightBucket):
            raise RefitError(f"update_weights takes WeightBucket(s), got {type(b).__name__}")
        transport_named(b.transport)
    return items


def merge_buckets(per_rank: Sequence[Sequence[WeightBucket]]) -> list[WeightBucket]:
    """One update from the CUDA IPC buckets of several trainer ranks colocated with the engines.

    Args:
        per_rank: each rank's buckets (``iter_buckets(source, "cuda_ipc")`` on its own GPU).

    Raises:
        RefitError: no ranks, ranks that packed other buckets or tensors than rank 0, a bucket
            not of ``cuda_ipc``, two ranks on one GPU.

    For FSDP or Megatron ranks, each holding the full tensors after gathering them: the driver
    merges their buckets, and each engine worker finds the handle for its GPU. Every rank must
    pack the same tensors in the same buckets, and keep its buckets alive until
    ``update_weights`` returns."""
    if not per_rank:
        raise RefitError("merge_buckets takes each trainer rank's buckets; got none")
    counts = {len(b) for b in per_rank}
    if len(counts) > 1:
        raise RefitError(f"trainer ranks packed different numbers of buckets: {[len(b) for b in per_rank]}")
    merged = []
    for i, buckets in enumerate(zip(*per_rank)):
        first = buckets[0]
        kinds = [b.transport for b in buckets]
        if len(set(kinds)) > 1:
            raise RefitError(f"bucket {i}: the ranks packed it for different transports {kinds}")
        for rank, bucket in enumerate(buckets):
            if (bucket.metas, bucket.offsets) != (first.metas, first.offsets):
                raise RefitError(
                    f"bucket {i}: rank {rank} packed other tensors than rank 0 "
                    "(the same source and bucket_bytes on every rank?)"
                )
        try:
            payload = first.via.merge([b.payload for b in buckets])
        except RefitError as exc:
            raise RefitError(f"bucket {i}: {exc}") from None
        merged.append(WeightBucket(first.transport, first.metas, payload, first.offsets))
    return merged


def named_tensors(source: torch.nn.Module | Mapping[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs of a module's state dict or of a mapping. A tensor that is another
    one under a second name (tied weights, e.g. ``lm_head.weight`` of a model that ties it to the
    embeddings) is given once: the engine's model ties them the same way."""
    items = source.state_dict().items() if isinstance(source, torch.nn.Module) else source.items()
    # by address first: only tensors that share one are compared whole (a refit reads every
    # tensor's key each step, and a trainer's model has hundreds)
    seen: dict[int, list[torch.Tensor]] = {}
    for name, tensor in items:
        at = seen.setdefault(tensor.data_ptr(), [])
        if at and tensor.numel() and _identity(tensor) in map(_identity, at):
            continue
        at.append(tensor)
        yield name, tensor.detach() if tensor.requires_grad else tensor


def _identity(tensor: torch.Tensor) -> tuple[Any, ...]:
    """What makes two tensors one: where they lie and how they are read."""
    return (tensor.device, tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), tensor.stride())


def gpu_bucket_bytes(free_bytes: int) -> int:
    """The bucket size for a source on a GPU with ``free_bytes`` free: a quarter of it, within
    ``GPU_BUCKET_BYTES``."""
    low, high = GPU_BUCKET_BYTES
    return max(low, min(high, free_bytes // 4))


def default_bucket_bytes(source: torch.nn.Module | Mapping[str, torch.Tensor]) -> int:
    """The bucket size when the caller gives none: ``gpu_bucket_bytes`` of the free memory of
    the GPU ``source`` is on, else ``DEFAULT_BUCKET_BYTES``."""
    first = next(named_tensors(source), None)
    if first is None or first[1].device.type != "cuda":
        return DEFAULT_BUCKET_BYTES
    return gpu_bucket_bytes(torch.cuda.mem_get_info(first[1].device)[0])


def iter_buckets(
    source: torch.nn.Module | Mapping[str, torch.Tensor],
    transport: Transport,
    *,
    bucket_bytes: int | None = None,
    dtype: torch.dtype | None = None,
    check_finite: bool = True,
    devices: Sequence[str] | None = None,
) -> Iterator[WeightBucket]:
    """Trainer-side helper: pack ``source`` into buckets for ``transport``, one at a time.

    Args:
        source: a module or a state dict.
        bucket_bytes: about this many bytes a bucket (None: ``default_bucket_bytes``).
        dtype, check_finite, devices: as ``pack_bucket``'s.

    Raises:
        RefitError: for a bad source or argument (before any bucket), or a bucket that holds a
            NaN or an infinity (``check_finite``).

    A cast or a copy into shared memory or a flat GPU buffer never holds more than one bucket
    beyond the model. Tensors of one module group (``module_group``) never straddle two buckets:
    engines fuse siblings such as q/k/v or gate/up and must receive them together."""
    for group in bucket_groups(source, bucket_bytes, dtype):
        yield pack_bucket(group, transport, dtype=dtype, check_finite=check_finite, devices=devices)


def bucket_groups(
    source: torch.nn.Module | Mapping[str, torch.Tensor],
    bucket_bytes: int | None = None,
    dtype: torch.dtype | None = None,
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The named tensors of each bucket ``iter_buckets`` packs (module groups kept whole).

    Raises:
        RefitError: for a bad source, ``bucket_bytes`` or ``dtype`` (checked first)."""
    check_source(source)
    check_bucket_bytes(bucket_bytes)
    check_dtype(dtype)
    named = list(named_tensors(source))
    check_readable(named)
    if bucket_bytes is None:
        bucket_bytes = default_bucket_bytes(source)
    for group in grouped(named, bucket_bytes, dtype):
        yield [named[i] for i in group]


def grouped(
    named: Sequence[tuple[str, torch.Tensor]], bucket_bytes: int, dtype: torch.dtype | None
) -> Iterator[list[int]]:
    """The indices into ``named`` of each bucket of about ``bucket_bytes`` (after the cast to
    ``dtype``), module groups kept whole."""
    group: list[int] = []
    size = 0
    last_key = None
    for i, (name, tensor) in enumerate(named):
        nbytes = tensor.numel() * (dtype or tensor.dtype).itemsize
        key = module_group(name)
        if group and key != last_key and size + nbytes > bucket_bytes:
            yield group
            group, size = [], 0
        group.append(i)
        size += nbytes
        last_key = key
    if group:
        yield group


def pack_bucket(
    named: Iterable[tuple[str, torch.Tensor]],
    transport: Transport,
    *,
    dtype: torch.dtype | None = None,
    check_finite: bool = True,
    devices: Sequence[str] | None = None,
) -> WeightBucket:
    """Pack named tensors for ``transport``.

    Args:
        named: (name, tensor) pairs.
        dtype: cast to it first (None: no cast).
        check_finite: check the values, after the cast.
        devices: for ``cuda_ipc``, the UUIDs of the GPUs to make handles for (the engines').

    Raises:
        RefitError: a tensor holds a NaN or an infinity (``check_finite``); for ``cuda_ipc``, a
            GPU of ``devices`` the source's GPU cannot reach; an unknown transport."""
    via = transport_named(transport)
    names, tensors = [], []
    for name, tensor in named:
        t = tensor.detach()
        if dtype is not None and t.dtype != dtype:
            t = t.to(dtype)
        names.append(name)
        tensors.append(t.contiguous())
    if check_finite:
        require_finite(zip(names, tensors))
    metas = tuple(TensorMeta.of(n, t) for n, t in zip(names, tensors))
    packed = via.pack(tensors, metas, devices)
    return WeightBucket(transport, metas, packed.payload, packed.offsets, held=packed.held)
