"""The engine rank's side of a bucket: ``Receiver`` unpacks it, keeps the named tensors of a kept
layout between refits (so later refits of it send only its name), and releases them; and the
load into a module."""

from __future__ import annotations

import pickle
from collections.abc import Iterable

import torch

from rollgen.refit.bucket import WeightBucket
from rollgen.refit.layouts import KEPT_LAYOUTS, KeptLayouts
from rollgen.refit.meta import Named
from rollgen.refit.transports import TRANSPORTS


def release_staged(keys: Iterable[str]) -> None:
    """Let go of what this process maps under ``keys`` (the trainer's staging buffers, the
    tensors it has read in place; it frees them once every receiver has), on every transport."""
    keys = list(keys)
    for transport in TRANSPORTS.values():
        transport.release(keys)


class Receiver:
    """One engine rank's end of refits: it unpacks each bucket sent as ``(layout, data)`` on
    ``device`` and keeps a kept layout's named tensors (views of kept mappings), ``capacity`` of
    them (``KeptLayouts``: the driver's mirror of them has the same capacity)."""

    def __init__(self, device: torch.device | str | None = None, capacity: int = KEPT_LAYOUTS) -> None:
        self.device = device
        self.kept: KeptLayouts[str, Named] = KeptLayouts(capacity)

    def unpack(self, layout: str, data: bytes | None) -> tuple[Named, bool] | None:
        """The named tensors of a bucket sent as ``(layout, data)``, and whether they are kept.

        Args:
            layout: the bucket's kept layout ("": none).
            data: the bucket's pickle (``WeightBucket.unpack``); None for a layout held here.

        Returns None where ``data`` is None and the layout is not held here (send the pickle). A kept
        layout's tensors are the same list each time it comes (do not change it) until
        ``release``."""
        named = self.kept.get(layout) if layout else None
        if named is not None:
            return named, True
        if data is None:
            return None
        bucket: WeightBucket = pickle.loads(data)
        named = bucket.unpack(self.device)
        if not bucket.layout:
            return named, False
        self.kept.keep(bucket.layout, named)  # the least recently used goes (rotating partial refits)
        return named, True

    def release(self, keys: Iterable[str]) -> None:
        """Forget every kept layout and let go of the mappings ``keys`` (``release_staged``)."""
        self.kept.clear()
        release_staged(keys)


@torch.no_grad()
def load_into_module(module: torch.nn.Module, named: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy validated named tensors into ``module``'s state (in place; tied weights once each)."""
    state = module.state_dict()
    for name, tensor in named:
        state[name].copy_(tensor)
