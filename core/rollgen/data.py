"""``BatchedDataDict``: a dict of equal-batch-size tensors and lists."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from itertools import chain
from typing import Any, Generic, TypeVar

import torch

T = TypeVar("T", bound=Mapping[str, Any])


class BatchedDataDict(dict, Generic[T]):  # type: ignore[type-arg]
    """Values are tensors (batch on dim 0) or lists (one item per sample), all of one batch size."""

    @property
    def size(self) -> int:
        """The batch size; raises ValueError when values disagree."""
        sizes = {k: (v.shape[0] if isinstance(v, torch.Tensor) else len(v)) for k, v in self.items()}
        distinct = set(sizes.values())
        if len(distinct) > 1:
            raise ValueError(f"values have different batch sizes: {sizes}")
        return distinct.pop() if distinct else 0

    def slice(self, start: int, end: int) -> BatchedDataDict[T]:
        """Samples ``start:end`` of every value."""
        return BatchedDataDict({k: v[start:end] for k, v in self.items()})

    def select_indices(self, indices: Sequence[int] | torch.Tensor) -> BatchedDataDict[T]:
        """The samples at ``indices``, in that order."""
        idx = torch.as_tensor(indices, dtype=torch.long)
        out: dict[str, Any] = {}
        for k, v in self.items():
            out[k] = v[idx] if isinstance(v, torch.Tensor) else [v[i] for i in idx.tolist()]
        return BatchedDataDict(out)

    def shard_by_batch_size(self, shards: int, allow_uneven_shards: bool = False) -> list[BatchedDataDict[T]]:
        """Split into ``shards`` contiguous shards, in order.

        Uneven shards (only when allowed) differ in size by at most one, larger ones first; a
        shard may be empty when the batch is smaller than ``shards``.
        """
        if shards < 1:
            raise ValueError(f"shards must be >= 1, got {shards}")
        total = self.size
        if total % shards and not allow_uneven_shards:
            raise ValueError(
                f"batch of {total} does not split into {shards} equal shards; pass allow_uneven_shards=True"
            )
        base, extra = divmod(total, shards)
        bounds, start = [], 0
        for i in range(shards):
            end = start + base + (1 if i < extra else 0)
            bounds.append((start, end))
            start = end
        return [self.slice(a, b) for a, b in bounds]

    @classmethod
    def from_batches(
        cls,
        batches: Sequence[Mapping[str, Any]],
        pad_value_dict: Mapping[str, float | int] | None = None,
    ) -> BatchedDataDict[Any]:
        """Concatenate batches along dim 0, right-padding tensors whose later dims differ.

        ``pad_value_dict`` gives each key's pad value (default 0).
        """
        pads = dict(pad_value_dict or {})
        if not batches:
            return cls()
        keys = list(batches[0].keys())
        for i, b in enumerate(batches):
            if list(b.keys()) != keys and set(b.keys()) != set(keys):
                raise ValueError(f"batch {i} has keys {sorted(b)}, expected {sorted(keys)}")
        out: dict[str, Any] = {}
        for k in keys:
            values = [b[k] for b in batches]
            if isinstance(values[0], torch.Tensor):
                out[k] = _cat_padded(values, pads.get(k, 0))
            else:
                out[k] = [item for v in values for item in v]
        return cls(out)

    def to(self, device: str | torch.device) -> BatchedDataDict[T]:
        """Move every tensor to ``device`` (in place); returns self."""
        for k, v in self.items():
            if isinstance(v, torch.Tensor):
                self[k] = v.to(device)
        return self


def right_pad(
    rows: Sequence[Sequence[float]] | Sequence[Sequence[int]],
    pad_value: float | int,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` of different lengths → ([B, longest] right-padded with ``pad_value``, lengths [B])."""
    lengths = torch.tensor([len(r) for r in rows], dtype=torch.long)
    width = int(lengths.max()) if len(rows) else 0
    out = torch.full((len(rows), width), pad_value, dtype=dtype)
    if width:
        mask = torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)
        out[mask] = torch.tensor(list(chain.from_iterable(rows)), dtype=dtype)
    return out, lengths


def unpad(input_ids: torch.Tensor, input_lengths: torch.Tensor) -> list[tuple[int, ...]]:
    """Each row's first ``input_lengths[i]`` ids (a right-padded batch's unpadded prompts)."""
    return [tuple(row[:n].tolist()) for row, n in zip(input_ids, input_lengths.tolist())]


def _cat_padded(tensors: Sequence[torch.Tensor], pad_value: float | int) -> torch.Tensor:
    if tensors[0].dim() <= 1:
        return torch.cat(list(tensors), dim=0)
    trailing = [max(t.shape[d] for t in tensors) for d in range(1, tensors[0].dim())]
    padded = []
    for t in tensors:
        if list(t.shape[1:]) == trailing:
            padded.append(t)
            continue
        full = torch.full((t.shape[0], *trailing), pad_value, dtype=t.dtype, device=t.device)
        full[tuple(slice(0, s) for s in t.shape)] = t
        padded.append(full)
    return torch.cat(padded, dim=0)
