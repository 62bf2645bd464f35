"""The replacement policy of a ``RayGeneration``'s replicas (``rollgen.distributed.replicas``):
what the death of one does (``engine_failures``).

"fail" (the default): the death ends the generation, as ``serialised`` records it. "replace":
the dead replica is taken out of service (its actor, and the engine processes under it, are
killed as a unit) and a new actor is started on its bundles at once, in the background (Ray
starts it while the driver goes on). The samples it held are re-run on the surviving replicas
(``Replicas.shard``; streamed ones by the dispatcher). A new replica is STALE until it holds the
generation's current weight version: at the next ``generate`` or ``submit`` after it reported
ready (or ``RayGeneration.restore_replicas``), it is sent the weights the fleet keeps
(``RetainedWeights``: the latest value of every tensor an update from this process sent) and
only then serves. Updates made while it started count, since the fleet keeps the latest ones;
an update that came over a weight-sync group cannot be retained (a new engine cannot join a
group of fixed size), so a replica that would need it stays out, with the reason, until a
complete update from this process or over a new group (``Replicas.sync_members``: every
replica joins it, a replacement too)."""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

import torch

from rollgen.distributed.replicas import Replicas
from rollgen.errors import WorkerError
from rollgen.refit.bucket import WeightBucket, grouped, pack_bucket
from rollgen.refit.meta import Transport
from rollgen.refit.transports import transport_named

logger = logging.getLogger(__name__)

#: The largest bucket a catch-up sends a new replica.
CATCH_UP_BUCKET_BYTES = 1 << 30


class CatchUp(Protocol):
    """How a new engine is brought to the current weights and adapter versions (the Ray refit
    link's ``adopt``; ``give_adapters`` for one that received the weights over a weight-sync group)."""

    def adopt(self, engine: int, buckets: Iterable[WeightBucket]) -> None: ...

    def give_adapters(self, engine: int) -> None: ...


class RetainedWeights:
    """A host copy of the latest value of every tensor updated from this process, and the
    weight version that makes it current; ``missing``: why it is not (an update over a
    weight-sync group), until a complete update from this process."""

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self.version = 0
        self.missing: str | None = None

    def keep(self, named: Iterable[tuple[str, torch.Tensor]], partial: bool, version: int) -> None:
        """Retain an update that completed as ``version``."""
        copies = {n: t.detach().to("cpu", copy=True) for n, t in named}
        if partial:
            self.tensors.update(copies)
        else:
            self.tensors, self.missing = copies, None
        self.version = version

    def lose(self, why: str, version: int) -> None:
        """An update (now ``version``) that could not be retained."""
        self.missing, self.version = why, version

    def why_not_current(self, version: int) -> str | None:
        """Why these weights cannot bring a new replica to ``version`` (None: they can)."""
        if self.missing is not None:
            return self.missing
        if self.version != version:
            return f"the fleet kept weight version {self.version}, the generation is at {version}"
        return None

    def buckets(self, transport: Transport) -> list[WeightBucket]:
        """The retained tensors packed for ``transport`` (none: the start-up weights are current)."""
        named = list(self.tensors.items())
        groups = grouped(named, CATCH_UP_BUCKET_BYTES, None)
        return [pack_bucket([named[i] for i in g], transport, check_finite=False) for g in groups]


class Fleet:
    """The ``engine_failures`` policy over ``replicas`` (a listener of theirs), from the engine
    config: with "replace", a replica that leaves service is replaced, and a replacement that
    started is brought to the current weights (``link``, from the tensors the fleet keeps)
    before it serves. Its methods run under the replicas' lock."""

    def __init__(
        self,
        replicas: Replicas,
        link: CatchUp,
        engine: Mapping[str, Any],
        transport: Transport,
        version: Callable[[], int],
    ) -> None:
        #: ``version()``: the generation's current weight version.
        self.replicas, self.link, self.version = replicas, link, version
        self.replaces = engine["engine_failures"] == "replace"
        self.max_restarts, self.window_s = int(engine["max_restarts"]), float(engine["restart_window_s"])
        #: What a catch-up packs with: the engines' transport of host tensors.
        self.transport = transport_named(transport).host
        self.weights = RetainedWeights()
        #: When each replica was replaced, within the restart window.
        self._restarted_at: list[deque[float]] = [deque() for _ in range(len(replicas))]
        replicas.listen(self)

    # ---- deaths ---------------------------------------------------------------------------------
    def replica_left(self, index: int) -> None:
        """With "replace": start a new actor for replica ``index``, unless it reached the
        restart limit."""
        if not self.replaces:
            return
        replicas, now = self.replicas, time.monotonic()
        restarted_at = self._restarted_at[index]
        while restarted_at and now - restarted_at[0] > self.window_s:
            restarted_at.popleft()
        if len(restarted_at) >= self.max_restarts:
            replicas.stays_out(
                index,
                f"{replicas.table[index].last_error}; replaced {self.max_restarts} time(s) within "
                f"{self.window_s:.0f} s (max_restarts, restart_window_s): it stays out",
            )
            return
        restarted_at.append(now)
        replicas.restart(index, f"replacement {replicas.table[index].restarts + 1}")

    def replica_returned(self, index: int) -> None:
        """Nothing to do: it was this policy that put it back."""

    # ---- admission ------------------------------------------------------------------------------
    def admit(self, timeout_s: float | None = 0.0) -> None:
        """With "replace": bring every replica that started (waiting up to ``timeout_s`` for
        those starting; None: until they answer) to the current weights and put it in service;
        one that cannot be brought there stays out with the reason."""
        if not self.replaces:
            return
        with self.replicas.lock:
            self.replicas.started(timeout_s)
            for index, replica in enumerate(self.replicas.table):
                if replica.state == "stale":
                    self._catch_up(index)

    def _catch_up(self, index: int) -> None:
        version = self.version()
        why = self.weights.why_not_current(version)
        if why is not None:
            self.replicas.stays_out(index, why)
            return
        try:
            self.link.adopt(index, self.weights.buckets(self.transport))
        except WorkerError as exc:
            self.replicas.take_out(index, f"bringing it to weight version {version} failed: {exc}")
            return
        self.replicas.serve(index, version)

    def _serve_synced(self, index: int, version: int) -> None:
        """A stale member of the weight-sync group received a complete update: with the adapter
        versions held, it serves."""
        try:
            self.link.give_adapters(index)
        except WorkerError as exc:
            self.replicas.take_out(index, f"loading the adapter versions held failed: {exc}")
            return
        self.replicas.serve(index, version)

    # ---- updates --------------------------------------------------------------------------------
    def updated(self, named: Iterable[tuple[str, torch.Tensor]] | None, partial: bool) -> None:
        """An update completed (``WeightUpdates.on_update``): the replicas in service hold the
        new version; ``named``: its tensors, which a replacement will need (None: they came over
        a weight-sync group)."""
        version = self.version()
        self.replicas.updated(version)
        if not self.replaces:
            return
        if named is None and not partial:  # a complete update reached every member, stale ones too
            with self.replicas.lock:
                for index in self.replicas.sync_group:
                    if self.replicas.table[index].state == "stale":
                        self._serve_synced(index, version)
        if named is None:
            self.weights.lose(
                f"weight version {version} came over a weight-sync group, which a new engine cannot join",
                version,
            )
        else:
            self.weights.keep(named, partial, version)
