"""Weight refit: trainer-side bucketing, the transports, and validation before apply.

Transports (``WeightBucket.transport``):
- ``tensors``: the tensors themselves (in-process, or copied through the Ray object store);
- ``shared_memory``: CPU tensors in shared memory, sent as a few KB of handles (zero-copy when the
  trainer's tensors already live in shared memory; otherwise one bucket-sized copy). Handles are
  made each time the bucket is pickled, one set per receiver, so pack it in the process that
  sends it to the engines (across processes, use ``tensors``);
- ``cuda_ipc``: CUDA IPC handles keyed by device UUID, for trainer and engine on the same GPUs.
"""

from __future__ import annotations

import io
import math
import pickle
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from multiprocessing.reduction import ForkingPickler
from typing import Any, Literal, TypeVar

import torch

from rollgen.errors import RefitError
from rollgen.spec import Capability

Transport = Literal["tensors", "shared_memory", "cuda_ipc"]
TRANSPORT_CAPABILITY: dict[str, Capability] = {
    "tensors": Capability.REFIT_TENSORS,
    "shared_memory": Capability.REFIT_TENSORS,
    "cuda_ipc": Capability.REFIT_IPC,
}
#: Bucket size for a source in host memory.
DEFAULT_BUCKET_BYTES = 1 << 30
#: Bounds of the bucket size for a source on a GPU (a quarter of its free memory): one 4 GiB
#: bucket refits a 1.5B model in 21.0 ms on an H200, 1 GiB buckets in 30.1 ms (BENCHMARKS.md,
#: 2026-11-30, 6e72348).
GPU_BUCKET_BYTES = (64 << 20, 4 << 30)
#: Offsets of tensors in a flat bucket buffer are multiples of this (any dtype can view them).
FLAT_ALIGN = 256


#: Named tensors, as a refit takes them.
Named = Sequence[tuple[str, torch.Tensor]]


@dataclass(frozen=True)
class TensorMeta:
    name: str
    shape: tuple[int, ...]
    dtype: str

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor, dtype: torch.dtype | None = None) -> TensorMeta:
        """The meta of ``tensor`` (as cast to ``dtype``, when given)."""
        return cls(name, tuple(tensor.shape), dtype_name(dtype or tensor.dtype))

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * getattr(torch, self.dtype).itemsize


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class WeightSpec(dict[str, tuple[tuple[int, ...], str]]):
    """What a refit of the served model sends: HF name → (full shape, dtype name). ``tied`` maps
    each name that shares its tensor with an earlier one (``lm_head.weight`` of a model that ties
    it to the embeddings) to that name: a refit sends the tensor once, under either name."""

    def __init__(
        self,
        items: Mapping[str, tuple[tuple[int, ...], str]] | None = None,
        tied: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(items or {})
        self.tied = dict(tied or {})

    @classmethod
    def of_module(cls, module: torch.nn.Module, dtype: torch.dtype | None = None) -> WeightSpec:
        """The spec of ``module``'s state dict (its dtypes, or ``dtype``); tensors registered under
        several names (tied weights) are one tensor."""
        spec = cls()
        tied: dict[str, str] = {}
        first: dict[int, str] = {}
        for name, tensor in module.state_dict(keep_vars=True).items():
            spec[name] = (tuple(tensor.shape), dtype_name(dtype or tensor.dtype))
            if id(tensor) in first:
                tied[name] = first[id(tensor)]
            else:
                first[id(tensor)] = name
        spec.tied = tied
        return spec

    def missing(self, names: Iterable[str], partial: bool = False) -> list[str]:
        """The names a refit sending ``names`` leaves out (a tied tensor is sent under one of
        its names). ``partial``: only those of the module groups it sends (engines fuse the
        tensors of a group, so a partial update sends whole groups)."""
        names = list(names)
        sent = {self.tied.get(n, n) for n in names}
        groups = {module_group(n) for n in names}
        return [
            n for n in self if self.tied.get(n, n) not in sent and (not partial or module_group(n) in groups)
        ]


@dataclass(frozen=True)
class IpcHandle:
    """How a receiver maps one GPU's flat buffer of a ``cuda_ipc`` bucket: torch's export of it
    (``rebuild(*args)``). ``key`` names a staging buffer (``rollgen.staging``), which a receiver
    maps the first time it sees it and keeps until ``release_staged``; None: a buffer of this
    bucket alone, mapped for it."""

    rebuild: Callable[..., torch.Tensor]
    args: tuple[Any, ...]
    key: str | None = None

    @classmethod
    def export(cls, buf: torch.Tensor, key: str | None = None) -> IpcHandle:
        """A new export of ``buf`` (torch pairs each export with one receiver's mapping)."""
        from torch.multiprocessing.reductions import reduce_tensor

        rebuild, args = reduce_tensor(buf)
        return cls(rebuild, tuple(args), key)


@dataclass(frozen=True)
class InPlaceViews:
    """How a receiver reads a colocated trainer's own tensors in place (``rollgen.in_place``):
    an export of each storage they lie in (bytes, kept mapped under its key like a staging
    buffer), and where each tensor lies in one: (storage, byte offset, strides), in the order
    of the bucket's metas."""

    storages: tuple[IpcHandle, ...]
    places: tuple[tuple[int, int, tuple[int, ...]], ...]

    def views(self, metas: Sequence[TensorMeta], index: int) -> list[torch.Tensor]:
        """The trainer's tensors, mapped on local GPU ``index`` (no copy)."""
        storages = [_mapped(h, index).untyped_storage() for h in self.storages]
        out = []
        for meta, (storage, offset, stride) in zip(metas, self.places, strict=True):
            dtype = getattr(torch, meta.dtype)
            view = torch.empty(0, dtype=dtype, device=storages[storage].device)
            out.append(view.set_(storages[storage], offset // dtype.itemsize, meta.shape, stride))
        return out


#: The staging buffers this process maps (a receiver's side of ``IpcHandle.key``).
_staged: dict[str, torch.Tensor] = {}
#: The named tensors of the kept layouts this process unpacked (``WeightBucket.layout``: views
#: of mappings kept until ``release_staged``), the ``KEPT_UNPACKED`` used last.
_unpacked: dict[str, list[tuple[str, torch.Tensor]]] = {}
KEPT_UNPACKED = 8


def release_staged(keys: Iterable[str]) -> None:
    """Unmap the staging buffers ``keys`` in this process (the trainer frees a buffer once every
    receiver has let it go)."""
    for key in keys:
        _staged.pop(key, None)
    _unpacked.clear()


def unpack_request(
    layout: str, data: bytes | None, device: torch.device | str | None = None
) -> tuple[list[tuple[str, torch.Tensor]], bool] | None:
    """The named tensors of a bucket sent as ``(layout, data)``: ``data`` its pickle
    (``WeightBucket.unpack``), None for a layout this process holds; and whether they are kept.
    A kept layout's tensors are views of kept mappings, the same list each time it comes (do not
    change it) until ``release_staged``. None: ``data`` is None and the layout is not held here
    (send the pickle)."""
    named = _unpacked.pop(layout, None) if layout else None
    if named is not None:
        _unpacked[layout] = named  # the most recent now
        return named, True
    if data is None:
        return None
    bucket: WeightBucket = pickle.loads(data)
    named = bucket.unpack(device)
    if not bucket.layout:
        return named, False
    if len(_unpacked) >= KEPT_UNPACKED:  # the least recently used goes (rotating partial refits)
        del _unpacked[next(iter(_unpacked))]
    _unpacked[bucket.layout] = named
    return named, True


@dataclass
class WeightBucket:
    """A bounded group of named tensors, packed for one transport. Picklable."""

    transport: Transport
    metas: tuple[TensorMeta, ...]
    payload: Any
    #: Byte offset of each tensor in the flat buffer (``shared_memory`` and ``cuda_ipc``).
    offsets: tuple[int, ...] = ()
    #: Names a layout kept between refits (``rollgen.staging``, ``rollgen.in_place``): the payload
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
        """The named tensors, on the engine side (for ``cuda_ipc``, on this process's device)."""
        if self.transport == "tensors":
            tensors = list(self.payload)
        elif self.transport == "shared_memory":
            tensors = unflatten(self.resolve()._keepalive[0], self.metas, self.offsets)
        elif self.transport == "cuda_ipc":
            entry, index = _gpu_entry(self.payload, device)
            if isinstance(entry, InPlaceViews):
                tensors = entry.views(self.metas, index)
            else:
                tensors = unflatten(_mapped(entry, index), self.metas, self.offsets)
        else:
            raise RefitError(f"unknown refit transport {self.transport!r}")
        return [(m.name, t) for m, t in zip(self.metas, tensors, strict=True)]


def merge_buckets(per_rank: Sequence[Sequence[WeightBucket]]) -> list[WeightBucket]:
    """One update from the CUDA IPC buckets of several trainer ranks colocated with the engines
    (FSDP or Megatron ranks, each holding the full tensors after gathering them): rank r packs
    ``iter_buckets(source, "cuda_ipc")`` on its own GPU, the driver merges them, and each engine
    worker finds the handle for its GPU. Every rank must pack the same tensors in the same
    buckets, and keep its buckets alive until ``update_weights`` returns."""
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


def check_reach(bucket: WeightBucket, engine_devices: Iterable[str]) -> None:
    """RefitError unless a CUDA IPC bucket holds a handle for each of ``engine_devices`` (GPU
    UUIDs), checked on the driver before anything is sent."""
    engine_devices = list(engine_devices)
    missing = sorted(set(engine_devices) - set(bucket.payload)) if bucket.transport == "cuda_ipc" else []
    if missing:
        raise RefitError(
            f"refit over CUDA IPC: the engines run on GPUs {engine_devices}, the update holds "
            f"tensors on {sorted(bucket.payload)} only; nothing was sent. CUDA IPC needs the "
            "trainer's tensors on every engine GPU: with trainer ranks colocated on them, pack "
            "buckets on each rank and merge them (rollgen.merge_buckets); otherwise refit over a "
            "weight-sync group (docs/contract.md, 'Where the trainer is')",
            [f"no handle for engine GPU {uuid}" for uuid in missing],
        )


def check_source(source: Any) -> None:
    """RefitError unless ``source`` is a module or a mapping of names to torch tensors."""
    if isinstance(source, torch.nn.Module):
        return
    if not isinstance(source, Mapping):
        raise RefitError(
            f"a refit source is a torch.nn.Module or a mapping of names to tensors (a state dict), "
            f"got {type(source).__name__}"
        )
    bad = [str(k) for k, v in source.items() if not (isinstance(k, str) and isinstance(v, torch.Tensor))]
    if bad:
        raise RefitError("a state dict maps parameter names to torch tensors; these entries do not", bad)


def check_bucket_bytes(bucket_bytes: Any) -> None:
    """RefitError unless ``bucket_bytes`` is None or a positive integer."""
    if bucket_bytes is not None and (
        isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes <= 0
    ):
        raise RefitError(
            f"bucket_bytes must be None (the default size) or a positive int, got {bucket_bytes!r}"
        )


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
    """Trainer-side helper: pack ``source`` into buckets of about ``bucket_bytes`` (None:
    ``default_bucket_bytes``). Buckets are made one at a time, so a cast or a copy into shared
    memory or a flat GPU buffer never holds more than one bucket beyond the model. Tensors of one
    module group (``module_group``) never straddle two buckets: engines fuse siblings such as
    q/k/v or gate/up and must receive them together. Each bucket is checked for NaN and infinite
    values after the cast (``check_finite``). ``devices``: as ``pack_bucket``'s."""
    for group in bucket_groups(source, bucket_bytes, dtype):
        yield pack_bucket(group, transport, dtype=dtype, check_finite=check_finite, devices=devices)


def bucket_groups(
    source: torch.nn.Module | Mapping[str, torch.Tensor],
    bucket_bytes: int | None = None,
    dtype: torch.dtype | None = None,
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The named tensors of each bucket ``iter_buckets`` packs (module groups kept whole)."""
    check_bucket_bytes(bucket_bytes)
    if bucket_bytes is None:
        bucket_bytes = default_bucket_bytes(source)
    named = list(named_tensors(source))
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


def module_group(name: str) -> str:
    """The unit engines fuse parameters within: the block of a projection
    (``model.layers.3.self_attn.q_proj.weight`` → ``model.layers.3.self_attn``: engines fuse
    q/k/v, and gate/up in ``mlp``), else the parameter's own module (``model.norm.weight`` →
    ``model.norm``)."""
    module = name.rpartition(".")[0] or name
    parent, _, leaf = module.rpartition(".")
    return parent if parent and leaf.endswith("_proj") else module


@torch.no_grad()
def nonfinite(named: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
    """The names of the floating-point tensors that hold a NaN or an infinity: one fused 2-norm
    pass (in float32, float64 tensors in their own) and one host sync per device, with no kernel
    per tensor beyond it; a tensor whose norm is not finite is then checked element-wise (a huge
    but finite tensor overflows its norm)."""
    bad = []
    for (_, wide), group in _norm_groups(named).items():
        norms = _norms(group, wide)
        if not bool(norms.isfinite().all()):
            bad += _exactly_nonfinite(group, norms)
    return bad


def _norm_groups(
    named: Iterable[tuple[str, torch.Tensor]],
) -> dict[tuple[torch.device, bool], list[tuple[str, torch.Tensor]]]:
    """The floating-point tensors, by device and by whether they are float64 (``_foreach_norm``
    takes no narrowing dtype)."""
    groups: dict[tuple[torch.device, bool], list[tuple[str, torch.Tensor]]] = {}
    for name, tensor in named:
        if tensor.is_floating_point() and tensor.numel():
            groups.setdefault((tensor.device, tensor.dtype == torch.float64), []).append((name, tensor))
    return groups


def _norms(group: Sequence[tuple[str, torch.Tensor]], wide: bool) -> torch.Tensor:
    """Each tensor's 2-norm (float32, or float64 for ``wide`` groups), one fused pass."""
    tensors = [t for _, t in group]
    return torch.stack(torch._foreach_norm(tensors, 2, dtype=None if wide else torch.float32))


def _exactly_nonfinite(group: Sequence[tuple[str, torch.Tensor]], norms: torch.Tensor) -> list[str]:
    """Of the tensors whose norm is not finite, those that hold a NaN or an infinity."""
    suspects = (~norms.isfinite()).nonzero().flatten().tolist()
    return [group[i][0] for i in suspects if not bool(torch.isfinite(group[i][1]).all())]


class GraphedCheck:
    """``nonfinite`` of tensors that stay where they are (the same storages, places and forms at
    every call: a trainer's parameters, refitted in place), its fused norms captured once as a
    CUDA graph on their GPU and replayed: one launch instead of one per chunk of tensors (1.33
    against 1.98 ms for 3.09 GB on an H200). The tensors must outlive it."""

    def __init__(self, named: Named) -> None:
        self._groups = list(_norm_groups(named).items())
        if self._groups:
            self._graph, (self._norms, self._finite) = graphed(self._run, self._groups[0][0][0])

    def _run(self) -> tuple[list[torch.Tensor], torch.Tensor]:
        norms = [_norms(group, wide) for (_, wide), group in self._groups]
        return norms, torch.stack([n.isfinite().all() for n in norms]).all()

    @torch.no_grad()
    def nonfinite(self) -> list[str]:
        """What ``nonfinite`` of the tensors returns now."""
        if not self._groups:
            return []
        self._graph.replay()
        if bool(self._finite):
            return []
        return [
            name
            for (_, group), norms in zip(self._groups, self._norms)
            for name in _exactly_nonfinite(group, norms)
        ]


T = TypeVar("T")


@torch.no_grad()
def graphed(fn: Callable[[], T], device: torch.device) -> tuple[torch.cuda.CUDAGraph, T]:
    """``fn`` (work on GPU ``device``) captured as a CUDA graph, on a stream of its own after a
    first run off the capture (lazy initialisation): the graph, which replays on the current
    stream, and what ``fn`` returned in the capture (outputs each replay rewrites). The calling
    thread keeps its stream when the capture fails."""
    with torch.cuda.device(device):
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(side):
            fn()
            with torch.cuda.graph(graph, stream=side, capture_error_mode="thread_local"):
                out = fn()
        torch.cuda.current_stream(device).wait_stream(side)
    return graph, out


def require_finite(named: Iterable[tuple[str, torch.Tensor]]) -> None:
    """RefitError naming every tensor that holds a NaN or an infinity."""
    reject_nonfinite(nonfinite(named))


def reject_nonfinite(bad: list[str]) -> None:
    """RefitError naming the tensors ``bad`` (holding a NaN or an infinity), if any."""
    if bad:
        raise RefitError(
            f"weight update rejected: {len(bad)} tensor(s) hold NaN or infinite values; nothing of "
            "them was applied (check the trainer's step; check_finite=False skips this check)",
            bad,
        )


def pack_bucket(
    named: Iterable[tuple[str, torch.Tensor]],
    transport: Transport,
    *,
    dtype: torch.dtype | None = None,
    check_finite: bool = True,
    devices: Sequence[str] | None = None,
) -> WeightBucket:
    """Pack named tensors for ``transport`` (casting to ``dtype`` first when given). RefitError
    if a tensor holds a NaN or an infinity, after the cast (unless ``check_finite`` is False).
    ``devices``: for ``cuda_ipc``, the UUIDs of the GPUs to make handles for (the engines')."""
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
        payload, keep = _ipc_handles(tensors, metas, offsets, devices)
        return WeightBucket(transport, metas, payload, offsets, _keepalive=keep)
    raise RefitError(f"unknown refit transport {transport!r}; use tensors, shared_memory or cuda_ipc")


def flat_offsets(sizes: Iterable[int]) -> tuple[int, ...]:
    """Byte offsets of tensors of ``sizes`` bytes laid end to end, each aligned to FLAT_ALIGN;
    the last entry is the buffer's size."""
    offsets, end = [], 0
    for nbytes in sizes:
        offsets.append(end)
        end += -(-nbytes // FLAT_ALIGN) * FLAT_ALIGN
    return (*offsets, end)


def flatten(
    tensors: list[torch.Tensor],
    metas: tuple[TensorMeta, ...],
    offsets: tuple[int, ...],
    device: torch.device,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One uint8 buffer on ``device`` holding the bytes of ``tensors`` (described by ``metas``)
    at ``offsets`` (one fused copy when the tensors are on ``device`` already); ``out``: that
    buffer, given (at least ``offsets[-1]`` bytes)."""
    buf = torch.empty(offsets[-1], dtype=torch.uint8, device=device) if out is None else out
    copy_into(unflatten(buf, metas, offsets), tensors)
    return buf


def copy_into(views: Sequence[torch.Tensor], tensors: Sequence[torch.Tensor]) -> None:
    """Copy each tensor into its view (casting): one fused copy where all are on one device."""
    if tensors and all(t.device == views[0].device for t in tensors):
        torch._foreach_copy_(list(views), list(tensors))
    else:
        for view, t in zip(views, tensors):
            view.copy_(t)


def mirror(buffers: Sequence[torch.Tensor], nbytes: int) -> None:
    """Copy the first ``nbytes`` of the first buffer into each other one (device to device)."""
    for buf in buffers[1:]:
        buf[:nbytes].copy_(buffers[0][:nbytes])


def unflatten(
    buf: torch.Tensor, metas: tuple[TensorMeta, ...], offsets: tuple[int, ...]
) -> list[torch.Tensor]:
    """Views of ``buf`` with the shapes and dtypes of ``metas`` (no copy)."""
    out = []
    for m, start in zip(metas, offsets):
        out.append(buf[start : start + m.nbytes].view(getattr(torch, m.dtype)).view(m.shape))
    return out


def device_uuid(device: torch.device | int | None = None) -> str:
    """The UUID of a CUDA device, the key of CUDA IPC payloads."""
    return str(
        torch.cuda.get_device_properties(torch.cuda.current_device() if device is None else device).uuid
    )


def ipc_targets(tensors: Sequence[torch.Tensor], devices: Sequence[str] | None = None) -> list[torch.device]:
    """The GPUs a ``cuda_ipc`` bucket of ``tensors`` gets a flat buffer on, the tensors' own GPU
    first: the GPUs of ``devices`` (UUIDs; each must be visible here), else the tensors' GPU, or
    (for CPU tensors) every visible GPU."""
    on = {t.device for t in tensors}
    if len(on) > 1:
        raise RefitError(f"cuda_ipc bucket tensors sit on several devices {sorted(map(str, on))}")
    source = on.pop() if on else torch.device("cpu")
    if not torch.cuda.is_available():
        raise RefitError("cuda_ipc needs CUDA; use the shared_memory transport on CPU")
    visible = {device_uuid(i): torch.device("cuda", i) for i in range(torch.cuda.device_count())}
    if devices is not None:
        unseen = [d for d in devices if d not in visible]
        if unseen:
            raise RefitError(
                f"refit over CUDA IPC: engine GPUs {unseen} are not visible to this process (it sees "
                f"{sorted(visible)}); nothing was sent. Refit from a process that sees every engine "
                "GPU, merge the buckets of trainer ranks on them (rollgen.merge_buckets), or refit "
                "over a weight-sync group (docs/contract.md, 'Where the trainer is')"
            )
        return sorted({visible[d] for d in devices}, key=lambda d: d != source)
    return [source] if source.type == "cuda" else list(visible.values())


def _ipc_handles(
    tensors: list[torch.Tensor],
    metas: tuple[TensorMeta, ...],
    offsets: tuple[int, ...],
    devices: Sequence[str] | None = None,
) -> tuple[dict[str, IpcHandle], list[torch.Tensor]]:
    """One flat buffer and its IPC handle for every target GPU (``ipc_targets``), so each engine
    rank finds its GPU's handle by UUID: one fused copy into the first (on the tensors' GPU),
    one device-to-device copy of it into each other."""
    if not tensors:
        return {}, []
    buffers = [torch.empty(offsets[-1], dtype=torch.uint8, device=d) for d in ipc_targets(tensors, devices)]
    flatten(tensors, metas, offsets, buffers[0].device, out=buffers[0])
    mirror(buffers, offsets[-1])
    return {device_uuid(b.device): IpcHandle.export(b) for b in buffers}, buffers


def _gpu_entry(
    payload: dict[str, IpcHandle | InPlaceViews], device: torch.device | str | None
) -> tuple[IpcHandle | InPlaceViews, int]:
    """This process's GPU's entry of a CUDA IPC payload, and that GPU's local index."""
    index = torch.device(device).index if device is not None else None
    index = torch.cuda.current_device() if index is None else index
    uuid = device_uuid(index)
    if uuid not in payload:
        raise RefitError(
            f"no CUDA IPC handles for this engine's GPU {uuid}; the payload has {sorted(payload)}. "
            "cuda_ipc needs trainer and engine colocated on the same GPUs"
        )
    return payload[uuid], index


def _mapped(handle: IpcHandle, index: int) -> torch.Tensor:
    """The memory ``handle`` exports, mapped on local GPU ``index`` (kept under its key)."""
    if handle.key is not None and handle.key in _staged:
        return _staged[handle.key]
    args = list(handle.args)
    args[6] = index  # the producer's device index → ours (same physical GPU)
    buf = handle.rebuild(*args)
    if handle.key is not None:
        _staged[handle.key] = buf
    return buf


@torch.no_grad()
def load_into_module(module: torch.nn.Module, named: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy validated named tensors into ``module``'s state (in place; tied weights once each)."""
    state = module.state_dict()
    for name, tensor in named:
        state[name].copy_(tensor)


def check_against_spec(metas: Iterable[TensorMeta], expected: WeightSpec, partial: bool = False) -> None:
    """Raise RefitError listing every unknown name, shape or dtype mismatch, and every tensor of
    the served model the update leaves out (``partial``: of the module groups it sends)."""
    metas = list(metas)
    problems = []
    for m in metas:
        if m.name not in expected:
            problems.append(f"{m.name}: not a parameter of the served model")
            continue
        shape, dtype = expected[m.name]
        if tuple(m.shape) != tuple(shape):
            problems.append(f"{m.name}: shape {list(m.shape)}, the model has {list(shape)}")
        if m.dtype != dtype:
            problems.append(f"{m.name}: dtype {m.dtype}, the model has {dtype} (pass dtype= to cast)")
    missing = expected.missing((m.name for m in metas), partial)
    if missing and partial:
        problems += [f"{n}: missing; a partial update sends whole module groups" for n in missing]
    elif missing:
        problems += [f"{n}: missing (pass partial=True for a deliberate partial update)" for n in missing]
    if problems:
        raise RefitError(
            f"weight update rejected ({len(problems)} problem(s)); nothing was applied and the "
            "engine keeps its previous weights",
            problems,
        )
