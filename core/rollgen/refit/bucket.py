"""Buckets: a bounded group of named tensors packed for one transport (``tensors``,
``shared_memory``, ``cuda_ipc``), the trainer's packing of a source into them, their sizes, and the
merge of colocated trainer ranks' CUDA IPC buckets."""

from __future__ import annotations

import io
import pickle
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from multiprocessing.reduction import ForkingPickler
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
from rollgen.refit.cuda_ipc import InPlaceViews, IpcHandle, gpu_entry, ipc_handles, mapped
from rollgen.refit.meta import (
    TRANSPORT_CAPABILITY,
    TensorMeta,
    Transport,
    flat_offsets,
    flatten,
    module_group,
    unflatten,
)

#: Bucket size for a source in host memory.
DEFAULT_BUCKET_BYTES = 1 << 30


#: Bounds of the bucket size for a source on a GPU (a quarter of its free memory): fewer, larger
#: buckets refit faster (BENCHMARKS.md, the refit by bucket size).
GPU_BUCKET_BYTES = (64 << 20, 4 << 30)


@dataclass
class WeightBucket:
    """A bounded group of named tensors, packed for one transport. Picklable."""

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
    _keepalive: list[torch.Tensor] = field(default_factory=list, repr=False, compare=False)

    def __getstate__(self) -> dict[str, Any]:
        payload = self.payload
        if self.transport == "shared_memory" and self._keepalive:
            # torch's file_system handles open once per pickle: fresh handles for each receiver
            buf = io.BytesIO()
            ForkingPickler(buf, pickle.HIGHEST_PROTOCOL).dump(self._keepalive)
            payload = buf.getvalue()
        return {
            "transport": self.transport,
            "metas": self.metas,
            "payload": payload,
            "offsets": self.offsets,
            "layout": self.layout,
        }

    def for_receiver(self, payload: Mapping[str, IpcHandle | InPlaceViews]) -> WeightBucket:
        """This kept layout's bucket as one receiver gets it: with its own ``payload`` of handles."""
        return WeightBucket(self.transport, self.metas, payload, self.offsets, self.layout)

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _keepalive=[])

    def resolve(self) -> WeightBucket:
        """Map a received shared-memory bucket into this process (its handle opens once), so it
        can be unpacked here and re-sent onwards with a fresh handle. Returns self."""
        if self.transport == "shared_memory" and not self._keepalive:
            torch.multiprocessing.set_sharing_strategy("file_system")
            self._keepalive = pickle.loads(self.payload)
            self.payload = None
        return self

    def unpack(self, device: torch.device | str | None = None) -> list[tuple[str, torch.Tensor]]:
        """The named tensors, on the engine side.

        Args:
            device: for ``cuda_ipc``, the GPU to map them on (None: this process's device).

        Raises:
            RefitError: for an unknown transport, or (``cuda_ipc``) no handle for the GPU."""
        if self.transport == "tensors":
            tensors = list(self.payload)
        elif self.transport == "shared_memory":
            tensors = unflatten(self.resolve()._keepalive[0], self.metas, self.offsets)
        elif self.transport == "cuda_ipc":
            entry, index = gpu_entry(self.payload, device)
            if isinstance(entry, InPlaceViews):
                tensors = entry.views(self.metas, index)
            else:
                tensors = unflatten(mapped(entry, index), self.metas, self.offsets)
        else:
            raise RefitError(f"unknown refit transport {self.transport!r}")
        return [(m.name, t) for m, t in zip(self.metas, tensors, strict=True)]


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
        if b.transport not in TRANSPORT_CAPABILITY:
            raise RefitError(f"unknown refit transport {b.transport!r}")
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
        payload: dict[str, Any] = {}
        for rank, bucket in enumerate(buckets):
            if bucket.transport != "cuda_ipc":
                raise RefitError(
                    f"merge_buckets merges cuda_ipc buckets; rank {rank} packed {bucket.transport!r}"
                )
            if (bucket.metas, bucket.offsets) != (first.metas, first.offsets):
                raise RefitError(
                    f"bucket {i}: rank {rank} packed other tensors than rank 0 "
                    "(the same source and bucket_bytes on every rank?)"
                )
            shared = sorted(set(payload) & set(bucket.payload))
            if shared:
                raise RefitError(f"bucket {i}: rank {rank} is on GPU(s) {shared} as another rank is")
            payload.update(bucket.payload)
        merged.append(WeightBucket("cuda_ipc", first.metas, payload, first.offsets))
    return merged


def named_tensors(source: torch.nn.Module | Mapping[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs of a module's state dict or of a mapping. A tensor that is another
    one under a second name (tied weights, e.g. ``lm_head.weight`` of a model that ties it to the
    embeddings) is given once: the engine's model ties them the same way."""
    items = source.state_dict().items() if isinstance(source, torch.nn.Module) else source.items()
    seen: set[tuple[Any, ...]] = set()
    for name, tensor in items:
        key = (tensor.device, tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), tensor.stride())
        if tensor.numel() and key in seen:
            continue
        seen.add(key)
        yield name, tensor.detach() if tensor.requires_grad else tensor


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
            GPU of ``devices`` the source's GPU cannot reach."""
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
    if transport == "tensors":
        return WeightBucket(transport, metas, tensors)
    offsets = flat_offsets(m.nbytes for m in metas)
    if transport == "shared_memory":
        torch.multiprocessing.set_sharing_strategy("file_system")
        buf = flatten(tensors, metas, offsets, torch.device("cpu")).share_memory_()
        return WeightBucket(transport, metas, None, offsets, _keepalive=[buf])
    if transport == "cuda_ipc":
        payload, keep = ipc_handles(tensors, metas, offsets, devices)
        return WeightBucket(transport, metas, payload, offsets, _keepalive=keep)
    raise RefitError(f"unknown refit transport {transport!r}; use tensors, shared_memory or cuda_ipc")
