"""CPU tensors in shared memory (``shared_memory``), both ends: the trainer's one flat buffer
(zero-copy where its tensors lie in shared memory already; otherwise one bucket-sized copy), sent
as a few KB of handles, and the receiver's mapping of it. torch's ``file_system`` handles open
once per pickle: each receiver gets a pickle of its own, made as it is pickled, so pack a bucket
in the process that sends it to the engines (across processes, use ``tensors``)."""

from __future__ import annotations

import io
import pickle
from collections.abc import Sequence
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch

from rollgen.refit.meta import TensorMeta, flat_offsets, flatten, unflatten
from rollgen.refit.transports.base import BucketTransport, Packed, Packet, register
from rollgen.spec import Capability


class SharedMemory(BucketTransport):
    """One shared-memory buffer a bucket, its handles made afresh for every pickle."""

    name = "shared_memory"
    capability = Capability.REFIT_TENSORS
    shared_pickle = False
    host = "shared_memory"

    def pack(
        self, tensors: list[torch.Tensor], metas: tuple[TensorMeta, ...], devices: Sequence[str] | None
    ) -> Packed:
        torch.multiprocessing.set_sharing_strategy("file_system")
        offsets = flat_offsets(m.nbytes for m in metas)
        buf = flatten(tensors, metas, offsets, torch.device("cpu")).share_memory_()
        return Packed(None, offsets, [buf])

    def pickled_payload(self, bucket: Packet) -> Any:
        if not bucket.held:
            return bucket.payload
        buf = io.BytesIO()
        ForkingPickler(buf, pickle.HIGHEST_PROTOCOL).dump(bucket.held)
        return buf.getvalue()

    def resolve(self, bucket: Packet) -> None:
        if not bucket.held:
            torch.multiprocessing.set_sharing_strategy("file_system")
            bucket.held = pickle.loads(bucket.payload)  # the handles of a pickle made for this process
            bucket.payload = None

    def unpack(self, bucket: Packet, device: torch.device | str | None) -> list[torch.Tensor]:
        self.resolve(bucket)
        return unflatten(bucket.held[0], bucket.metas, bucket.offsets)


SHARED_MEMORY = register(SharedMemory())
