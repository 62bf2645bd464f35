"""The trainer's end of a weight-sync group (``WeightSender``): rank 0, which hosts the group's
store and broadcasts each update's manifest and buckets."""

from __future__ import annotations

import dataclasses
import logging
from collections import deque
from collections.abc import Mapping
from typing import Any

import torch

from rollgen.errors import RefitError
from rollgen.refit.bucket import bucket_groups, named_tensors
from rollgen.refit.checks import nonfinite
from rollgen.refit.meta import TensorMeta, dtype_name, flat_offsets, flatten
from rollgen.refit.transports.collective.group import SyncGroup, open_store, publish_record
from rollgen.refit.transports.collective.spec import SyncGroupSpec
from rollgen.refit.transports.collective.wire import Bucket, manifest_data

logger = logging.getLogger(__name__)


class WeightSender:
    """The trainer's end of a weight-sync group: rank 0, the broadcasts' root.

    Args:
        spec: the generation's ``weight_sync_spec``.
        device: the GPU an NCCL group sends from (None: the current CUDA device); gloo sends
            from host memory.

    Raises:
        RefitError: the group's store cannot be hosted at the spec's address and port.

    It hosts the group's TCP store at once (``spec.port`` 0: a free port); ``self.spec`` is the
    spec with the port, for the generation's ``init_weight_sync``. ``connect()`` (or the first
    ``send``) joins the group while ``init_weight_sync`` runs; both return once every rank has
    joined."""

    def __init__(self, spec: SyncGroupSpec, device: torch.device | None = None) -> None:
        self._store = open_store(spec, host=True)
        self.spec = dataclasses.replace(spec, port=self._store.port)
        publish_record(self._store, self.spec)
        self._device = device
        self._group: SyncGroup | None = None

    def connect(self) -> None:
        """Join the group (returns once every engine rank has joined)."""
        if self._group is None:
            self._group = SyncGroup(self.spec, 0, self._device, store=self._store)

    @property
    def group(self) -> SyncGroup:
        self.connect()
        assert self._group is not None  # set by connect
        return self._group

    def send(
        self,
        source: torch.nn.Module | Mapping[str, torch.Tensor],
        *,
        bucket_bytes: int | None = None,
        dtype: torch.dtype | None = None,
        partial: bool = False,
        check_finite: bool = True,
    ) -> None:
        """Broadcast ``source`` to every engine rank, while the generation's
        ``update_weights_from_collective`` receives it.

        Args:
            source: a module or a state dict.
            bucket_bytes, dtype, partial, check_finite: as the generation's ``refit``'s.

        Raises:
            RefitError: the source or the engines reject it (nothing applied), or an engine failed
                while applying it (``stale``: the generation refuses to generate until a complete
                refit); a group that broke earlier."""
        group = self.group
        group.check_usable()
        groups: list[list[tuple[str, torch.Tensor]]] = []
        buckets: tuple[Bucket, ...] = ()
        try:
            groups = list(bucket_groups(source, bucket_bytes, dtype))  # checks the arguments first
            buckets = tuple(_layout(g, dtype) for g in groups)
            error = _nonfinite_error(source, dtype) if check_finite else None
        except Exception as exc:  # noqa: BLE001 - sent to every rank in the manifest, raised below
            error = (
                exc
                if isinstance(exc, RefitError)
                else RefitError(f"the trainer could not prepare the update: {exc!r}")
            )
            groups, buckets = [], ()
        group.share(manifest_data(buckets, partial, error), root=0)
        if error is not None:
            raise error
        group.settle(None)  # the engines' checks of the manifest
        with group.applying():
            self._send_buckets(group, groups, buckets)

    def _send_buckets(
        self, group: SyncGroup, groups: list[list[tuple[str, torch.Tensor]]], buckets: tuple[Bucket, ...]
    ) -> None:
        failure: RefitError | None = None
        # two send buffers of the largest bucket, reused: fresh host memory per bucket costs
        # more in page faults than the copy into it
        largest = max((offsets[-1] for _, offsets in buckets), default=0) + 1
        pool: list[torch.Tensor] = []
        in_flight: deque[tuple[Any, torch.Tensor]] = deque()
        for i, (named, (metas, offsets)) in enumerate(zip(groups, buckets)):
            buf = None
            if failure is None:
                try:  # the copy into the flat buffer casts
                    if len(pool) < 2:
                        pool.append(torch.empty(largest, dtype=torch.uint8, device=group.device))
                    buf = pool[i % 2][: offsets[-1] + 1]  # (its last byte: the mark)
                    flatten([t for _, t in named], metas, offsets, group.device, out=buf)
                    buf[-1] = 0
                except Exception as exc:  # noqa: BLE001 - every rank raises it at the end
                    logger.exception("weight-sync sender: packing bucket %d failed", i + 1)
                    failure = RefitError(
                        f"the trainer failed to pack bucket {i + 1} of {len(buckets)} ({exc!r}); the "
                        "engines may hold part of the update",
                        stale=True,
                    )
            if buf is None:  # the receivers expect every bucket: send it marked as not to load
                buf = torch.ones(offsets[-1] + 1, dtype=torch.uint8, device=group.device)
            in_flight.append((group.broadcast(buf), buf))
            if len(in_flight) > 1:  # at most two buckets beyond the model
                _finish(group, *in_flight.popleft())
        while in_flight:
            _finish(group, *in_flight.popleft())
        group.settle(failure)  # the engines' loads

    def close(self) -> None:
        """Leave the group (the engines' ends go with their generation)."""
        self._group = None


def _layout(group: list[tuple[str, torch.Tensor]], dtype: torch.dtype | None) -> Bucket:
    metas = tuple(TensorMeta(n, tuple(t.shape), dtype_name(dtype or t.dtype)) for n, t in group)
    return metas, flat_offsets(m.nbytes for m in metas)


def _nonfinite_error(
    source: torch.nn.Module | Mapping[str, torch.Tensor], dtype: torch.dtype | None
) -> RefitError | None:
    """The source's tensors holding NaN or infinite values (also after a cast to ``dtype``
    narrower than theirs)."""
    named = list(named_tensors(source))
    bad = nonfinite(named)
    if dtype is not None and dtype.is_floating_point:
        limit = torch.finfo(dtype).max
        bad += [
            n
            for n, t in named
            if n not in bad and t.is_floating_point() and t.numel() and t.abs().max().item() > limit
        ]
    if not bad:
        return None
    return RefitError(
        f"weight update rejected: {len(bad)} tensor(s) hold NaN or infinite values (or overflow the "
        "cast); nothing of them was applied (check the trainer's step; check_finite=False skips this)",
        bad,
    )


def _finish(group: SyncGroup, work: Any, buf: torch.Tensor) -> None:
    """Wait for a broadcast to leave this process (the buffer may then be freed)."""
    group.wait(work, "sending a bucket")
    if buf.is_cuda:
        torch.cuda.current_stream(buf.device).synchronize()
