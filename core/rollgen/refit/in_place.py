"""Refit in place: the engines of a colocated trainer read its own tensors, mapped once and
kept, so a refit copies each byte once (into the engines' parameters), with no staging buffer.

``refit`` takes this path over CUDA IPC (where the backend has it on) when the source holds the
very tensors of the refit before it (the same names, storages, places, shapes and strides: a
trainer's parameters, which its optimizer updates in place), contiguous, all on the one GPU
every engine runs on, none empty, and nothing is cast. Otherwise it packs into the staging
buffers (``rollgen.refit.staging``) and notes the source, so the next refit of the same tensors goes
in place. Each engine worker gets its own export of each storage, made once, before anything is
sent (torch pairs an export with one receiver's mapping); a storage torch cannot export (memory
of another allocator) ends the refit with a ``RefitError`` before anything is sent, and later
refits of this generation go through the staging buffers.

The engines keep the mappings until ``release`` (the generation's ``release_refit_buffers``, a
source that changed, or shutdown), and this side keeps the storages: every storage the source's
tensors lie in, the whole model's, stays allocated until then, even where the trainer drops the
tensors (moving its model to the CPU, say); torch's IPC reference counting would keep them too."""

from __future__ import annotations

import logging
import pickle
import uuid
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import cast

import torch

from rollgen.errors import RefitError
from rollgen.refit.bucket import WeightBucket
from rollgen.refit.checks import GraphedCheck, nonfinite, reject_nonfinite
from rollgen.refit.meta import Named, TensorMeta
from rollgen.refit.transports.cuda_ipc import CUDA_IPC, InPlaceViews, IpcHandle, device_uuid

logger = logging.getLogger(__name__)

#: What tells a refit's tensors apart: its names, and each tensor's storage (weakly held), place,
#: shape, strides and dtype.
Fingerprint = tuple[tuple[str, ...], list[tuple["weakref.ref[torch.UntypedStorage]", int, object]]]


@dataclass
class _Sources:
    """The tensors read in place: their bucket, their fingerprint, their storages, each
    receiver's pickle of the bucket (with that receiver's exports), and their NaN check (made by
    the first refit that checks them)."""

    bucket: WeightBucket
    fingerprint: Fingerprint
    storages: list[torch.UntypedStorage]
    pickles: list[bytes]
    check: Callable[[], list[str]] | None = None


class InPlaceSources:
    """The trainer process's side of refits in place, for one generation (``cuda_ipc`` only)."""

    def __init__(self) -> None:
        #: The tensors of the last refit packed another way (a candidate for the next one).
        self._noted: Fingerprint | None = None
        self._sources: _Sources | None = None
        #: Names this set of exports apart from earlier ones (receivers key mappings by it).
        self._generation = ""
        #: Why refits of this generation no longer go in place (an export failed), if they do not.
        self._off: str | None = None

    @property
    def keys(self) -> list[str]:
        """The keys receivers map the storages under (what ``release_staged`` takes)."""
        return [self._key(i) for i in range(len(self._sources.storages))] if self._sources else []

    def applies(self, named: Named, dtype: torch.dtype | None, engine_devices: tuple[str, ...]) -> bool:
        """Whether a refit of ``named`` (cast to ``dtype``) may go in place: the tensors read in
        place already, or those of the last refit, on the one GPU of every engine, uncast."""
        if self._off is not None or (dtype is not None and any(t.dtype != dtype for _, t in named)):
            return False
        if self._sources is not None and _same(self._sources.fingerprint, named):
            return True
        return (
            self._noted is not None
            and bool(named)
            and all(t.numel() and t.is_contiguous() for _, t in named)
            and on_engine_gpu([t for _, t in named], engine_devices)
            and _same(self._noted, named)
        )

    def note(self, named: Named) -> None:
        """Remember the tensors of a refit packed another way."""
        self._noted = _fingerprint(named)

    def pack(self, named: Named, receivers: int, check_finite: bool) -> WeightBucket:
        """The bucket that has the engines read ``named`` in place, once the trainer's work on
        them is done.

        Args:
            named: the source (``applies`` was true).
            receivers: how many engine workers it is exported for.
            check_finite: check the values (``GraphedCheck``).

        Raises:
            RefitError: before anything is sent, where torch cannot export a storage, or a tensor
                holds a NaN or an infinity (``check_finite``).

        When they are not the tensors read in place already, none are: a changed source released
        them."""
        if self._sources is None:
            self._generation = uuid.uuid4().hex
            try:
                self._sources = self._export(named, receivers)
            except RuntimeError as exc:
                self._noted, self._off = None, str(exc)
                raise RefitError(
                    f"cannot share the trainer's tensors with the engines ({exc}); nothing was sent. "
                    "Refit again: this generation's refits go through the staging buffers from now on"
                ) from None
        if check_finite:
            reject_nonfinite(self._check(named))
        torch.cuda.synchronize(named[0][1].device)  # receivers read on their own streams
        return self._sources.bucket

    def _check(self, named: Named) -> list[str]:
        """``nonfinite(named)``, by the kept tensors' check: a CUDA graph made the first time
        (the plain check where torch cannot capture one)."""
        sources = cast(_Sources, self._sources)
        if sources.check is None:
            try:
                sources.check = GraphedCheck(named).nonfinite
            except RuntimeError as exc:
                logger.warning("the NaN check of the tensors read in place runs unreplayed: %s", exc)
                sources.check = partial(nonfinite, list(named))
        return sources.check()

    def holds(self, bucket: WeightBucket) -> bool:
        """Whether ``bucket`` is the one ``pack`` returns."""
        return self._sources is not None and bucket is self._sources.bucket

    def pickled(self, receiver: int) -> bytes:
        """Receiver ``receiver``'s pickle of the bucket ``pack`` returned (``holds``)."""
        return cast(_Sources, self._sources).pickles[receiver]

    def release(self) -> None:
        """Forget the tensors read in place (every receiver must have let go of them first:
        ``release_staged`` of ``keys``)."""
        self._sources = None

    def _key(self, storage: int) -> str:
        return f"{self._generation}:in-place:{storage}"

    def _export(self, named: Named, receivers: int) -> _Sources:
        storages, places = storage_places(named)
        metas = tuple(TensorMeta.of(n, t) for n, t in named)
        payload = {device_uuid(named[0][1].device): None}
        bucket = WeightBucket(CUDA_IPC.name, metas, payload, layout=f"{self._generation}:in-place")
        pickles = []
        for _ in range(receivers):
            exports = tuple(IpcHandle.export(bytes_of(s), self._key(i)) for i, s in enumerate(storages))
            views = InPlaceViews(exports, places)
            pickles.append(pickle.dumps(bucket.for_receiver(dict.fromkeys(bucket.payload, views))))
        return _Sources(bucket, _fingerprint(named), storages, pickles)


def on_engine_gpu(tensors: list[torch.Tensor], engine_devices: tuple[str, ...]) -> bool:
    """Whether every tensor is on the one GPU every engine runs on."""
    device = tensors[0].device
    return (
        device.type == "cuda"
        and all(t.device == device for t in tensors)
        and set(engine_devices) == {device_uuid(device)}
    )


def _fingerprint(named: Named) -> Fingerprint:
    return (
        tuple(n for n, _ in named),
        [(weakref.ref(t.untyped_storage()), t.data_ptr(), (t.shape, t.stride(), t.dtype)) for _, t in named],
    )


def _same(fingerprint: Fingerprint, named: Named) -> bool:
    """Whether ``named`` are the tensors ``fingerprint`` was taken of, where and as they were."""
    names, tensors = fingerprint
    return len(names) == len(named) and all(
        name == n
        and ref() is t.untyped_storage()
        and ptr == t.data_ptr()
        and form == (t.shape, t.stride(), t.dtype)
        for name, (ref, ptr, form), (n, t) in zip(names, tensors, named)
    )


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
    empty = torch.empty(0, dtype=torch.uint8, device=storage.device)
    return empty.set_(storage, 0, (storage.nbytes(),), (1,))
