"""The tensors themselves (``tensors``), both ends: in process, or copied through the Ray object
store (any pickle of them carries their bytes)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rollgen.refit.meta import TensorMeta
from rollgen.refit.transports.base import BucketTransport, Packed, Packet, register
from rollgen.spec import Capability


class Tensors(BucketTransport):
    """A bucket whose payload is its tensors."""

    name = "tensors"
    capability = Capability.REFIT_TENSORS

    def pack(
        self, tensors: list[torch.Tensor], metas: tuple[TensorMeta, ...], devices: Sequence[str] | None
    ) -> Packed:
        return Packed(tensors)

    def unpack(self, bucket: Packet, device: torch.device | str | None) -> list[torch.Tensor]:
        return list(bucket.payload)


TENSORS = register(Tensors())
