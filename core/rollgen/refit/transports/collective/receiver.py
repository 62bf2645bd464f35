"""An engine rank's part of each update over a weight-sync group (``receive``): check the
manifest against the served model, then receive each bucket while loading the last."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from rollgen.errors import RefitError
from rollgen.refit.checks import check_against_spec
from rollgen.refit.meta import WeightSpec, unflatten
from rollgen.refit.transports.collective.group import SyncGroup
from rollgen.refit.transports.collective.wire import Bucket, manifest_from

logger = logging.getLogger(__name__)


def receive(
    group: SyncGroup, spec: WeightSpec, load: Callable[[list[tuple[str, torch.Tensor]]], None]
) -> bool:
    """An engine rank's part of one update; returns whether the update was partial.

    Args:
        group: this rank's end of the group.
        spec: the served model's, which the update's manifest is checked against first.
        load: takes each bucket's named tensors (views of a receive buffer that the next
            buckets reuse: copy them).

    Raises:
        RefitError: the update rejected by any rank (nothing applied), a load or the group that
            failed while applying (``stale``), a group that broke earlier."""
    group.check_usable()
    buckets, partial = manifest_from(group.share(None, root=0))
    rejection = None
    try:
        check_against_spec((m for metas, _ in buckets for m in metas), spec, partial)
        # two receive buffers of the largest bucket (and its mark), taken before anything is
        # applied: a rank that cannot hold them rejects the update
        largest = max((offsets[-1] for _, offsets in buckets), default=0) + 1
        pool = [torch.empty(largest, dtype=torch.uint8, device=group.device) for _ in buckets[:2]]
    except RefitError as exc:
        rejection = exc
    except torch.OutOfMemoryError as exc:
        rejection = RefitError(
            f"engine rank {group.rank} cannot hold two buckets of {largest} bytes ({exc}); nothing "
            "was applied: send smaller buckets (bucket_bytes)"
        )
    group.settle(rejection)

    def post(i: int) -> tuple[Any, torch.Tensor]:
        buf = pool[i % 2][: buckets[i][1][-1] + 1]
        return group.broadcast(buf), buf

    with group.applying():
        _receive_buckets(group, buckets, post, load)
    return partial


def _receive_buckets(
    group: SyncGroup,
    buckets: tuple[Bucket, ...],
    post: Callable[[int], tuple[Any, torch.Tensor]],
    load: Callable[[list[tuple[str, torch.Tensor]]], None],
) -> None:
    failure: RefitError | None = None
    incoming = [post(0)] if buckets else []
    for i, (metas, offsets) in enumerate(buckets):
        work, buf = incoming.pop()
        group.wait(work, f"receiving bucket {i + 1} of {len(buckets)}")
        if i + 1 < len(buckets):
            incoming.append(post(i + 1))
        if failure is not None or int(buf[-1].item()) != 0:
            continue  # keep receiving (the sender's broadcasts need every rank); skip marked ones
        try:
            load([(m.name, t) for m, t in zip(metas, unflatten(buf, metas, offsets))])
        except Exception as exc:  # noqa: BLE001 - re-raised on every rank below, as a RefitError
            logger.exception("weight-sync rank %d: loading bucket %d failed", group.rank, i + 1)
            failure = RefitError(
                f"engine rank {group.rank} failed to load bucket {i + 1} of {len(buckets)} "
                f"({type(exc).__name__}: {exc}); replicas may now hold different weights",
                stale=True,
            )
    group.settle(failure)
