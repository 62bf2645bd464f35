"""What crosses a weight-sync group as data: an update's manifest (each bucket's tensor names,
shapes and dtypes, whether the update is partial, the sender's rejection) and a rank's
``RefitError``, both as JSON (nothing is unpickled; ``SyncGroup.share`` tags and checks them)."""

from __future__ import annotations

from typing import Any

import torch

from rollgen.errors import RefitError, _rebuild
from rollgen.refit.meta import TensorMeta, flat_offsets

#: A bucket's layout: its tensors' metas and their offsets in its flat buffer (the last: its size).
Bucket = tuple[tuple[TensorMeta, ...], tuple[int, ...]]

#: The most a manifest or an error message may take on the wire (a rank allocates no more).
MAX_MESSAGE_BYTES = 64 << 20


def error_data(error: RefitError | None) -> dict[str, Any]:
    assert error is not None  # only the rank whose error it is sends it
    return {"message": str(error), "problems": error.problems, "stale": error.stale}


def error_from(data: Any) -> RefitError:
    """The ``RefitError`` another rank sent (as data: the only type that crosses the group)."""
    try:
        message, problems, stale = (
            str(data["message"]),
            [str(p) for p in data["problems"]],
            bool(data["stale"]),
        )
    except (TypeError, KeyError) as exc:
        return RefitError(f"a weight-sync rank sent an error this rank cannot read ({exc!r})", stale=True)
    return _rebuild(RefitError, message, {"problems": problems, "stale": stale})  # type: ignore[return-value]


def manifest_data(buckets: tuple[Bucket, ...], partial: bool, error: RefitError | None) -> dict[str, Any]:
    return {
        "buckets": [[[m.name, list(m.shape), m.dtype] for m in metas] for metas, _ in buckets],
        "partial": partial,
        "error": None if error is None else error_data(error),
    }


def manifest_from(data: Any) -> tuple[tuple[Bucket, ...], bool]:
    """The buckets and partiality of a manifest (its sender's error raised)."""
    if data["error"] is not None:
        raise error_from(data["error"])
    buckets = []
    for bucket in data["buckets"]:
        metas = tuple(TensorMeta(str(n), tuple(int(d) for d in shape), str(dt)) for n, shape, dt in bucket)
        unknown = [m.dtype for m in metas if not isinstance(getattr(torch, m.dtype, None), torch.dtype)]
        if unknown:
            raise RefitError(f"the sender's manifest names dtypes torch does not have: {unknown}")
        buckets.append((metas, flat_offsets(m.nbytes for m in metas)))  # (checked against the spec first)
    return tuple(buckets), bool(data["partial"])
