"""Refit in place: the engines of a colocated trainer read its own tensors, mapped once and
kept, so a refit copies each byte once (into the engines' parameters), with no staging buffer.

``refit`` takes this path over CUDA IPC when the source holds the very tensors of the refit
before it (the same storages, at the same places: a trainer's parameters, which its optimizer
updates in place), all on the one GPU every engine runs on, none empty, and nothing is cast.
Otherwise it packs into the staging buffers (``rollgen.staging``) and notes the source, so the
next refit of the same tensors goes in place. Each engine worker gets its own export of each
storage, made once (torch pairs an export with one receiver's mapping).

The engines keep the mappings until ``release`` (the generation's ``release_refit_buffers``, a
source that changed, or shutdown). Until then torch's IPC reference counting keeps that memory
of the trainer's even where the trainer drops the tensors (moving its model to the CPU, say):
as much as the staging buffer it replaces would hold."""

from __future__ import annotations

import pickle
import uuid
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import cast

import torch

from rollgen.refit import InPlaceViews, IpcHandle, TensorMeta, WeightBucket, device_uuid

Named = Sequence[tuple[str, torch.Tensor]]
#: What tells a refit's tensors apart: each one's storage (weakly held), its place and strides.
Fingerprint = list[tuple["weakref.ref[torch.UntypedStorage]", int, tuple[int, ...]]]


@dataclass
class _Layout:
    """The tensors read in place: their bucket, what tells them apart, their storages."""

    bucket: WeightBucket
    fingerprint: Fingerprint
    storages: list[torch.UntypedStorage]
    places: tuple[tuple[int, int, tuple[int, ...]], ...]


class InPlaceSources:
    """The trainer process's side of refits in place, for one generation (``cuda_ipc`` only)."""

    def __init__(self) -> None:
        #: The tensors of the last refit packed another way (a candidate for the next one).
        self._noted: tuple[tuple[str, ...], Fingerprint] | None = None
        self._layout: _Layout | None = None
        #: Names this layout's exports apart from earlier ones (receivers key mappings by it).
        self._generation = ""
        #: Each receiver's pickle of the layout's bucket, with its own exports.
        self._pickles: dict[int, bytes] = {}

    @property
    def keys(self) -> list[str]:
        """The keys receivers map the storages under (what ``release_staged`` takes)."""
        return [self._key(i) for i in range(len(self._layout.storages))] if self._layout else []

    def applies(self, named: Named, dtype: torch.dtype | None, engine_devices: Iterable[str]) -> bool:
        """Whether a refit of ``named`` (cast to ``dtype``) may go in place: the tensors read in
        place already, or those of the last refit, on the one GPU of every engine, uncast."""
        if dtype is not None and any(t.dtype != dtype for _, t in named):
            return False
        if self._layout is not None and _same(self._layout.fingerprint, named):
            return True
        if self._noted is None or self._noted[0] != tuple(n for n, _ in named):
            return False
        tensors = [t for _, t in named]
        device = tensors[0].device if tensors else None
        return (
            device is not None
            and device.type == "cuda"
            and set(engine_devices) == {device_uuid(device)}
            and all(t.device == device and t.numel() for t in tensors)
            and _same(self._noted[1], named)
        )

    def note(self, named: Named) -> None:
        """Remember the tensors of a refit packed another way."""
        self._noted = (tuple(n for n, _ in named), _fingerprint(named))

    def pack(self, named: Named) -> WeightBucket:
        """The bucket that has the engines read ``named`` in place (``applies`` was true),
        once the trainer's work on them is done."""
        if self._layout is None or not _same(self._layout.fingerprint, named):
            self._layout = _new_layout(named)
            self._generation = uuid.uuid4().hex
            self._pickles.clear()
        torch.cuda.synchronize(named[0][1].device)  # receivers read on their own streams
        return self._layout.bucket

    def holds(self, bucket: WeightBucket) -> bool:
        """Whether ``bucket`` is the one ``pack`` returns."""
        return self._layout is not None and bucket is self._layout.bucket

    def pickled(self, bucket: WeightBucket, receiver: int) -> bytes:
        """Receiver ``receiver``'s pickle of the bucket ``pack`` returned (``holds``): with its
        own exports of the storages (made the first time)."""
        layout = cast(_Layout, self._layout)
        data = self._pickles.get(receiver)
        if data is None:
            exports = tuple(
                IpcHandle.export(bytes_of(s), self._key(i)) for i, s in enumerate(layout.storages)
            )
            views = InPlaceViews(exports, layout.places)
            data = self._pickles[receiver] = pickle.dumps(
                bucket.for_receiver(dict.fromkeys(bucket.payload, views))
            )
        return data

    def release(self) -> None:
        """Forget the tensors read in place (every receiver must have let go of them first:
        ``release_staged`` of ``keys``)."""
        self._layout = None
        self._pickles.clear()

    def _key(self, storage: int) -> str:
        return f"{self._generation}:in-place:{storage}"


def _fingerprint(named: Named) -> Fingerprint:
    return [(weakref.ref(t.untyped_storage()), t.data_ptr(), t.stride()) for _, t in named]


def _same(fingerprint: Fingerprint, named: Named) -> bool:
    """Whether ``named`` are the tensors ``fingerprint`` was taken of, where they were."""
    return len(fingerprint) == len(named) and all(
        ref() is t.untyped_storage() and ptr == t.data_ptr() and stride == t.stride()
        for (ref, ptr, stride), (_, t) in zip(fingerprint, named)
    )


def _new_layout(named: Named) -> _Layout:
    storages, places = storage_places(named)
    metas = tuple(TensorMeta.of(n, t) for n, t in named)
    bucket = WeightBucket("cuda_ipc", metas, {device_uuid(named[0][1].device): None}, staged=True)
    return _Layout(bucket, _fingerprint(named), storages, places)


def storage_places(
    named: Named,
) -> tuple[list[torch.UntypedStorage], tuple[tuple[int, int, tuple[int, ...]], ...]]:
    """The storages ``named`` lie in (each once), and each tensor's place in one: (storage,
    byte offset, strides), as ``InPlaceViews`` takes them."""
    storages: dict[int, tuple[int, torch.UntypedStorage]] = {}
    places = []
    for _, t in named:
        storage = t.untyped_storage()
        index, _ = storages.setdefault(storage.data_ptr(), (len(storages), storage))
        places.append((index, int(t.storage_offset()) * t.element_size(), tuple(t.stride())))
    return [s for _, s in storages.values()], tuple(places)


def bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over all of ``storage`` (what an export shares)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(
        storage, 0, (storage.nbytes(),), (1,)
    )
