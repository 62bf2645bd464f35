"""The contract's vocabulary of a weight update: names, ``TensorMeta``, ``WeightSpec``, module
groups, and the flat layout buckets share (tensors end to end in one byte buffer)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

Transport = Literal["tensors", "shared_memory", "cuda_ipc"]


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
        its names).

        Args:
            names: what the refit sends.
            partial: only those of the module groups it sends (engines fuse the tensors of a
                group, so a partial update sends whole groups)."""
        names = list(names)
        sent = {self.tied.get(n, n) for n in names}
        groups = {module_group(n) for n in names}
        return [
            n for n in self if self.tied.get(n, n) not in sent and (not partial or module_group(n) in groups)
        ]


def module_group(name: str) -> str:
    """The unit engines fuse parameters within: the block of a projection
    (``model.layers.3.self_attn.q_proj.weight`` → ``model.layers.3.self_attn``: engines fuse
    q/k/v, and gate/up in ``mlp``), else the parameter's own module (``model.norm.weight`` →
    ``model.norm``)."""
    module = name.rpartition(".")[0] or name
    parent, _, leaf = module.rpartition(".")
    return parent if parent and leaf.endswith("_proj") else module


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
    """One uint8 buffer on ``device`` holding the bytes of ``tensors``.

    Args:
        tensors: what to copy (cast to their ``metas``' dtypes as they are copied).
        metas, offsets: the buffer's layout (``flat_offsets``).
        device: where the buffer is.
        out: that buffer, given (at least ``offsets[-1]`` bytes); None: a new one.

    One fused copy when the tensors are on ``device`` already."""
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
    """Views of ``buf`` with the shapes and dtypes of ``metas`` (no copy): one strided view each
    of ``buf`` seen in its dtype (each offset is a multiple of ``FLAT_ALIGN``)."""
    typed: dict[str, torch.Tensor] = {}
    out = []
    for m, start in zip(metas, offsets):
        as_dtype = typed.get(m.dtype)
        if as_dtype is None:
            as_dtype = typed[m.dtype] = buf[: len(buf) - len(buf) % FLAT_ALIGN].view(getattr(torch, m.dtype))
        offset = as_dtype.storage_offset() + start // as_dtype.element_size()
        out.append(as_dtype.as_strided(m.shape, contiguous_strides(m.shape), offset))
    return out


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape``, in elements."""
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))
