"""The engine rank's side of a bucket: unpack it, keep the named tensors of a kept layout between
refits (so later refits of it send only its name), release them, and load into a module."""

from __future__ import annotations

import pickle
from collections.abc import Iterable

import torch

from rollgen.refit import cuda_ipc
from rollgen.refit.bucket import WeightBucket

#: The named tensors of the kept layouts this process unpacked (``WeightBucket.layout``: views
#: of mappings kept until ``release_staged``), the ``KEPT_UNPACKED`` used last.
_unpacked: dict[str, list[tuple[str, torch.Tensor]]] = {}


KEPT_UNPACKED = 8


def release_staged(keys: Iterable[str]) -> None:
    """Unmap the staging buffers ``keys`` in this process (the trainer frees a buffer once every
    receiver has let it go)."""
    cuda_ipc.unmap(keys)
    _unpacked.clear()


def unpack_request(
    layout: str, data: bytes | None, device: torch.device | str | None = None
) -> tuple[list[tuple[str, torch.Tensor]], bool] | None:
    """The named tensors of a bucket sent as ``(layout, data)``, and whether they are kept.

    Args:
        layout: the bucket's kept layout ("": none).
        data: the bucket's pickle (``WeightBucket.unpack``); None for a layout this process holds.
        device: for ``cuda_ipc``, the GPU to map it on.

    Returns None where ``data`` is None and the layout is not held here (send the pickle). A kept
    layout's tensors are views of kept mappings, the same list each time it comes (do not change
    it) until ``release_staged``."""
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


@torch.no_grad()
def load_into_module(module: torch.nn.Module, named: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy validated named tensors into ``module``'s state (in place; tied weights once each)."""
    state = module.state_dict()
    for name, tensor in named:
        state[name].copy_(tensor)
