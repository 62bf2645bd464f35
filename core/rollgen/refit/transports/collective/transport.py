"""An engine rank's end of a weight-sync group as a transport (``CollectiveReceiver``): it joins
the group and loads each update the trainer's ``WeightSender`` broadcasts over gloo or NCCL. For
trainers on other GPUs or hosts; no pickle crosses it (manifests and errors travel as
authenticated data)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from rollgen.errors import RefitError
from rollgen.refit.meta import Named, WeightSpec
from rollgen.refit.transports.collective.group import SyncGroup
from rollgen.refit.transports.collective.receiver import receive
from rollgen.refit.transports.collective.spec import SyncGroupSpec

__all__ = ["CollectiveReceiver"]


class CollectiveReceiver:
    """One engine rank's end of a weight-sync group: ``join`` it, then ``receive`` each update
    the sender (``WeightSender``, the trainer's end) broadcasts. A new ``join`` replaces the
    group (after a trainer restarts, or a failure broke it)."""

    def __init__(self) -> None:
        self._group: SyncGroup | None = None

    @property
    def joined(self) -> bool:
        return self._group is not None

    def join(self, spec: SyncGroupSpec, rank: int, device: torch.device) -> None:
        """Join ``spec``'s group as ``rank``, receiving on ``device`` (returns once every rank
        joined)."""
        self._group = SyncGroup(spec, rank, device)

    def receive(self, spec: WeightSpec, load: Callable[[Named], None]) -> bool:
        """Receive one update, checked against the served model's ``spec``, each bucket's named
        tensors handed to ``load`` (views of receive buffers reused two buckets later: ``load``
        copies them first); whether it was partial.

        Raises:
            RefitError: not joined; what ``receive`` raises."""
        if self._group is None:
            raise RefitError("no weight-sync group; call init_weight_sync first")
        return receive(self._group, spec, load)

    def leave(self) -> None:
        """Forget the group."""
        self._group = None
