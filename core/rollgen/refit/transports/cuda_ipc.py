"""CUDA IPC, both ends (``cuda_ipc``): the trainer's exports of flat buffers (one per engine GPU,
keyed by device UUID) and of its own storages read in place, and the receiver's mappings of them
(kept under their key until released). For trainer and engines colocated on the same GPUs."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rollgen.errors import RefitError
from rollgen.refit.meta import TensorMeta, flat_offsets, flatten, mirror, unflatten
from rollgen.refit.transports.base import BucketTransport, Packed, Packet, register
from rollgen.spec import Capability


@dataclass(frozen=True)
class IpcHandle:
    """How a receiver maps one GPU's flat buffer of a ``cuda_ipc`` bucket: torch's export of it
    (``rebuild(*args)``). ``key`` names a staging buffer (``rollgen.refit.staging``), which a receiver
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
    """How a receiver reads a colocated trainer's own tensors in place (``rollgen.refit.in_place``):
    an export of each storage they lie in (bytes, kept mapped under its key like a staging
    buffer), and where each tensor lies in one: (storage, byte offset, strides), in the order
    of the bucket's metas."""

    storages: tuple[IpcHandle, ...]
    places: tuple[tuple[int, int, tuple[int, ...]], ...]

    def views(self, metas: Sequence[TensorMeta], index: int) -> list[torch.Tensor]:
        """The trainer's tensors, mapped on local GPU ``index`` (no copy)."""
        storages = [mapped(h, index).untyped_storage() for h in self.storages]
        out = []
        for meta, (storage, offset, stride) in zip(metas, self.places, strict=True):
            dtype = getattr(torch, meta.dtype)
            view = torch.empty(0, dtype=dtype, device=storages[storage].device)
            out.append(view.set_(storages[storage], offset // dtype.itemsize, meta.shape, stride))
        return out


#: The staging buffers this process maps (a receiver's side of ``IpcHandle.key``).
_staged: dict[str, torch.Tensor] = {}


def unmap(keys: Iterable[str]) -> None:
    """Drop this process's mappings of the staging buffers ``keys``."""
    for key in keys:
        _staged.pop(key, None)


def device_uuid(device: torch.device | int | None = None) -> str:
    """The UUID of a CUDA device, the key of CUDA IPC payloads."""
    return str(
        torch.cuda.get_device_properties(torch.cuda.current_device() if device is None else device).uuid
    )


def ipc_targets(tensors: Sequence[torch.Tensor], devices: Sequence[str] | None = None) -> list[torch.device]:
    """The GPUs a ``cuda_ipc`` bucket of ``tensors`` gets a flat buffer on, the tensors' own first.

    Args:
        tensors: the bucket's tensors (all on one device).
        devices: the engines' GPUs (UUIDs); None: the tensors' GPU, or (CPU tensors) every
            visible GPU.

    Raises:
        RefitError: tensors on several devices, no CUDA, or a GPU of ``devices`` not visible
            here (nothing was sent)."""
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


def ipc_handles(
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


def gpu_entry(
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


def mapped(handle: IpcHandle, index: int) -> torch.Tensor:
    """The memory ``handle`` exports, mapped on local GPU ``index`` (kept under its key)."""
    if handle.key is not None and handle.key in _staged:
        return _staged[handle.key]
    args = list(handle.args)
    args[6] = index  # the producer's device index → ours (same physical GPU)
    buf = handle.rebuild(*args)
    if handle.key is not None:
        _staged[handle.key] = buf
    return buf


class CudaIpc(BucketTransport):
    """CUDA IPC handles keyed by device UUID: zero-copy for engines on the trainer's GPUs. A
    pickle of handles of GPU buffers may go to every receiver as it is (each maps it on its own
    GPU); a kept layout's bucket carries each receiver's own exports
    (``WeightBucket.for_receiver``), which it keeps mapped under their keys until ``release``."""

    name = "cuda_ipc"
    capability = Capability.REFIT_IPC
    stages = True

    def pack(
        self, tensors: list[torch.Tensor], metas: tuple[TensorMeta, ...], devices: Sequence[str] | None
    ) -> Packed:
        offsets = flat_offsets(m.nbytes for m in metas)
        payload, held = ipc_handles(tensors, metas, offsets, devices)
        return Packed(payload, offsets, held)

    def check_reach(self, payload: Any, engine_devices: Sequence[str]) -> None:
        engine_devices = list(engine_devices)
        missing = sorted(set(engine_devices) - set(payload))
        if missing:
            raise RefitError(
                f"refit over CUDA IPC: the engines run on GPUs {engine_devices}, the update holds "
                f"tensors on {sorted(payload)} only; nothing was sent. CUDA IPC needs the "
                "trainer's tensors on every engine GPU: with trainer ranks colocated on them, pack "
                "buckets on each rank and merge them (rollgen.merge_buckets); otherwise refit over a "
                "weight-sync group (docs/contract.md, 'Where the trainer is')",
                [f"no handle for engine GPU {uuid}" for uuid in missing],
            )

    def merge(self, payloads: Sequence[Any]) -> Any:
        merged: dict[str, Any] = {}
        for rank, payload in enumerate(payloads):
            shared = sorted(set(merged) & set(payload))
            if shared:
                raise RefitError(f"rank {rank} is on GPU(s) {shared} as another rank is")
            merged.update(payload)
        return merged

    def unpack(self, bucket: Packet, device: torch.device | str | None) -> list[torch.Tensor]:
        entry, index = gpu_entry(bucket.payload, device)
        if isinstance(entry, InPlaceViews):
            return entry.views(bucket.metas, index)
        return unflatten(mapped(entry, index), bucket.metas, bucket.offsets)

    def local(self, bucket: Packet) -> list[torch.Tensor]:
        if bucket.held and bucket.offsets:  # the packer's flat buffer: its own handles do not open here
            return unflatten(bucket.held[0], bucket.metas, bucket.offsets)
        return self.unpack(bucket, None)

    def release(self, keys: Iterable[str]) -> None:
        unmap(keys)


CUDA_IPC = register(CudaIpc())
