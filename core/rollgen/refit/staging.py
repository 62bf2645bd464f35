"""Staging buffers: where ``refit`` packs a colocated trainer's weights (or, in a staging of
their own, its adapters) for its engines over CUDA IPC. One persistent flat buffer per engine GPU,
packed anew by every refit; each engine worker gets its own export of each buffer once (torch
pairs an export with one receiver's mapping) and maps it once (``refit.IpcHandle.key``). A bucket
layout seen before (a trainer refits the same layout every step) reuses its views of the buffers,
its bucket and each receiver's pickle of it, so a refit after the first allocates, maps and
pickles nothing: it copies. The buffers stay until ``release`` (the generation's
``release_refit_buffers``, a larger bucket, or shutdown), after every receiver let them go."""

from __future__ import annotations

import pickle
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from rollgen.errors import RefitError
from rollgen.refit.bucket import WeightBucket
from rollgen.refit.checks import require_finite
from rollgen.refit.layouts import KeptLayouts
from rollgen.refit.meta import Named, TensorMeta, copy_into, flat_offsets, mirror, unflatten
from rollgen.refit.transports.cuda_ipc import CUDA_IPC, IpcHandle, device_uuid, ipc_targets


@dataclass
class _Layout:
    """A bucket layout packed before: its bucket (the same object every time), the buffers it
    is copied into (the one on the source's GPU first) and the views of the first."""

    bucket: WeightBucket
    buffers: list[torch.Tensor]
    views: list[torch.Tensor]


class RefitStaging:
    """The trainer process's staging buffers for one generation (``cuda_ipc`` only)."""

    def __init__(self) -> None:
        #: Each engine GPU's buffer, by GPU UUID.
        self._buffers: dict[str, torch.Tensor] = {}
        #: Names this set of buffers apart from earlier ones (receivers key mappings by it).
        self._generation = ""
        #: The export of each buffer made for each receiver: (GPU UUID, receiver) → handle.
        self._exports: dict[tuple[str, int], IpcHandle] = {}
        #: The bucket layouts packed before (their views, bucket and pickles).
        self._layouts: KeptLayouts[tuple[object, ...], _Layout] = KeptLayouts()
        #: Each receiver's pickle of a layout's bucket: (id of the bucket, receiver) → bytes.
        self._pickles: dict[tuple[int, int], bytes] = {}

    @property
    def keys(self) -> list[str]:
        """The keys receivers map the buffers under (what ``release_staged`` takes)."""
        return [self._key(d) for d in self._buffers]

    def fits(self, devices: Iterable[str], nbytes: int) -> bool:
        """Whether the buffers cover ``devices`` with ``nbytes`` each."""
        return all(d in self._buffers and self._buffers[d].numel() >= nbytes for d in devices)

    def allocate(self, devices: Sequence[str], nbytes: int) -> None:
        """New buffers of ``nbytes`` on the GPUs ``devices`` (UUIDs visible here), replacing any
        (whose receivers must have released them).

        Raises:
            RefitError: a GPU cannot hold one (nothing was sent); a GPU not visible here."""
        self.release()
        self._generation = uuid.uuid4().hex
        try:
            for device in ipc_targets([], devices):
                # zeros: ``_require_finite`` sums over the padding between tensors too (bytes
                # another layout left there only send it to the exact per-tensor check)
                self._buffers[device_uuid(device)] = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        except torch.OutOfMemoryError as exc:
            self.release()
            raise RefitError(
                f"cannot hold a staging buffer of {nbytes} bytes on each engine GPU ({exc}); nothing "
                "was sent: pass a smaller bucket_bytes, or free memory (release_refit_buffers)"
            ) from None

    @torch.no_grad()
    def pack(self, named: Named, dtype: torch.dtype | None, check_finite: bool) -> WeightBucket:
        """One bucket packed into the buffers, finished on every GPU before it returns.

        Args:
            named: the bucket's tensors. dtype: cast to it as they are copied.
            check_finite: check the packed values.

        Raises:
            RefitError: before it is sent, a packed value that is a NaN or an infinity
                (``check_finite``).

        Its payload names the GPUs; ``pickled`` gives each receiver's pickle of it, with that
        receiver's handles."""
        tensors = [t for _, t in named]
        key = (dtype, tensors[0].device if tensors else None, tuple((n, t.shape, t.dtype) for n, t in named))
        layout = self._layouts.get(key) or self._layout(key, named, dtype)
        copy_into(layout.views, tensors)
        mirror(layout.buffers, layout.bucket.offsets[-1])
        if check_finite:
            _require_finite(layout)
        for buf in layout.buffers:  # receivers read on their own streams once this returns
            torch.cuda.synchronize(buf.device)
        return layout.bucket

    def _layout(self, key: tuple[object, ...], named: Named, dtype: torch.dtype | None) -> _Layout:
        metas = tuple(TensorMeta.of(n, t, dtype) for n, t in named)
        offsets = flat_offsets(m.nbytes for m in metas)
        targets = ipc_targets([t for _, t in named], list(self._buffers)) if named else []
        buffers = [self._buffers[device_uuid(d)] for d in targets] or list(self._buffers.values())
        bucket = WeightBucket(
            CUDA_IPC.name,
            metas,
            dict.fromkeys(self._buffers),
            offsets,
            layout=uuid.uuid4().hex,
            held=buffers[:1],  # what ``copied`` reads here
        )
        layout = _Layout(bucket, buffers, unflatten(buffers[0], metas, offsets))
        for _, old in self._layouts.keep(key, layout):  # the least recently used goes
            self._pickles = {k: v for k, v in self._pickles.items() if k[0] != id(old.bucket)}
        return layout

    def holds(self, bucket: WeightBucket) -> bool:
        """Whether ``bucket`` is one ``pack`` returned (of a layout kept here)."""
        return any(layout.bucket is bucket for layout in self._layouts.values())

    def pickled(self, bucket: WeightBucket, devices: Iterable[str], receiver: int) -> bytes:
        """Receiver ``receiver``'s pickle of a bucket ``pack`` returned: with its handles of the
        buffers on ``devices`` (exported the first time), made once per layout."""
        key = (id(bucket), receiver)
        data = self._pickles.get(key)
        if data is None:
            handles = {}
            for device in devices:
                handle = self._exports.get((device, receiver))
                if handle is None:
                    handle = self._exports[(device, receiver)] = IpcHandle.export(
                        self._buffers[device], self._key(device)
                    )
                handles[device] = handle
            data = self._pickles[key] = pickle.dumps(bucket.for_receiver(handles))
        return data

    def release(self) -> None:
        """Drop the buffers (every receiver must have released them: ``release_staged``)."""
        self._pickles.clear()
        self._layouts.clear()
        self._exports.clear()
        self._buffers.clear()

    def _key(self, device: str) -> str:
        return f"{self._generation}:{device}"


def _require_finite(layout: _Layout) -> None:
    """RefitError naming the packed tensors that hold a NaN or an infinity: where they share a
    floating dtype, first one sum over the packed bytes, which is finite unless one is there (or
    the sum overflows, or padding holds another layout's bytes: then the tensors are checked one
    by one)."""
    metas, first = layout.bucket.metas, layout.buffers[0]
    dtypes = {m.dtype for m in metas}
    if len(dtypes) == 1:
        dtype = getattr(torch, dtypes.pop())
        flat = first[: layout.bucket.offsets[-1]].view(dtype)
        if not dtype.is_floating_point or bool(torch.isfinite(flat.sum(dtype=torch.float32))):
            return
    require_finite(zip((m.name for m in metas), layout.views))


def flat_sizes(groups: Sequence[Named], dtype: torch.dtype | None) -> list[int]:
    """The flat size of each bucket of ``groups`` (after the cast to ``dtype``)."""
    return [flat_offsets(t.numel() * (dtype or t.dtype).itemsize for _, t in g)[-1] for g in groups]
