"""``RayLink``: how weight updates reach engines in Ray actors — over each rank's refit channel
where they connect, else through the actors; into the staging buffers or, for a colocated
trainer's refit of the tensors it refitted last, read in place; and the one rule of what each
engine is sent (its own pickle: shared-memory handles open once per receiver, and a kept
layout's bucket carries that engine's own exports). Adapter versions go the same way (each rank
takes one between two of its engine's steps), and a copy of each version held is kept where it
was packed, for a replacement engine, which gets them through its actor. It is handed the replicas
(``rollgen.distributed.replicas``) and calls only down to them; it listens for a replica that
leaves service (its channels close)."""

from __future__ import annotations

import logging
import os
import pickle
from collections.abc import Callable, Iterable, Sequence

import ray
import torch

from rollgen.distributed.replicas import Replicas
from rollgen.distributed.worker import EngineWorker
from rollgen.errors import WorkerError
from rollgen.refit import Named, WeightBucket, WeightSpec, channel, pack_bucket
from rollgen.refit.bucket import FlatCopy
from rollgen.refit.channel import DropAdapter, EngineChannels, LoadAdapter
from rollgen.refit.in_place import InPlaceSources
from rollgen.refit.layouts import KEPT_LAYOUTS
from rollgen.refit.link import EngineFacts, Packing, pack_with
from rollgen.refit.meta import Transport
from rollgen.refit.staging import RefitStaging, flat_sizes
from rollgen.refit.transports import transport_named
from rollgen.refit.transports.collective import SyncGroupSpec

logger = logging.getLogger(__name__)

#: Seconds the driver waits for engines to let go of staging buffers (on release, or after a
#: bucket failed on one engine while others still read it).
STAGED_WAIT_S = 60.0


class RayLink:
    """The link to the engines of ``replicas`` (up): it opens their refit channels.

    Args:
        replicas: the engines. name: the backend's, for messages.
        transport: what ``refit()`` packs local sources with (``cuda_ipc`` on GPUs).
        sync_device: where the engines receive a weight-sync group's broadcasts.
        ranks_per_engine: the ranks each engine joins a weight-sync group with.
        in_place: a colocated trainer's refit of the tensors it refitted last has the engines
            read them in place (``rollgen.refit.in_place``), where the staging buffers serve."""

    #: How many kept layouts each engine rank keeps (and the driver's mirror of them).
    capacity = KEPT_LAYOUTS

    def __init__(
        self,
        replicas: Replicas,
        name: str,
        transport: Transport,
        sync_device: torch.device,
        ranks_per_engine: int,
        in_place: bool,
    ) -> None:
        self.replicas, self.group, self.name = replicas, replicas.group, name
        self.transport, self.sync_device, self.ranks_per_engine = transport, sync_device, ranks_per_engine
        #: Each engine rank's refit channel (none where the engines have none, or they do not
        #: connect), with the kept layouts each engine loaded over them.
        self.channels = EngineChannels(self._open_channels(), self.capacity)
        #: Where a refit packs into staging buffers (over CUDA IPC), when every worker reports
        #: its GPUs; and its refits in place, where the backend has them.
        self._staging = (
            RefitStaging()
            if transport_named(transport).stages and all(r.info["devices"] for r in replicas.table)
            else None
        )
        self._in_place = InPlaceSources() if self._staging is not None and in_place else None
        #: Where adapter refits pack (beside it: a weight refit's packing releases only its own).
        self._adapter_staging = RefitStaging() if self._staging is not None else None
        #: A copy of each adapter version the engines hold (what a replacement is sent).
        self._adapters: dict[int, FlatCopy] = {}
        replicas.listen(self)

    @property
    def facts(self) -> EngineFacts:
        """The engines' facts now (a replacement engine may run on other GPUs)."""
        table = self.replicas.table
        devices = tuple(uuid for r in table for uuid in r.info["devices"])
        sync_ranks = len(self.replicas) * self.ranks_per_engine
        versioned = all(r.info.get("versioned_prefixes", False) for r in table)
        return EngineFacts(self.transport, devices, self.sync_device, sync_ranks, False, versioned)

    def _open_channels(self) -> list[list[channel.Channel]]:
        """A refit channel to every engine rank, where every engine has them and they connect;
        else none (buckets go through the actors)."""
        authkey = self._authkey = os.urandom(32)
        try:
            addresses = self.replicas.call(EngineWorker.open_channels, authkey, self.capacity)
        except WorkerError as exc:
            if exc.died:
                raise
            logger.warning(
                "%s: refits go through the engines' actors: an engine opened no channel: %s",
                self.name,
                exc,
            )
            return []
        return channel.connect(addresses, authkey, self.replicas.names) if all(addresses) else []

    # ---- packing --------------------------------------------------------------------------------
    def packing(self, groups: list[Named], dtype: torch.dtype | None) -> Packing:
        """Over CUDA IPC, where every worker reports its GPUs: in place, as one bucket, where
        the source is the tensors of the last refit (``rollgen.refit.in_place``); else into the
        staging buffers, made (or replaced by larger ones) for the largest bucket first."""
        staging, in_place, facts = self._staging, self._in_place, self.facts
        if staging is None:
            return pack_with(facts, groups, dtype)
        named = [pair for group in groups for pair in group]
        if in_place is not None and in_place.applies(named, dtype, facts.devices):
            pack = in_place.pack
            dp = len(self.replicas)
            return Packing(
                [named],
                lambda group, check: pack(group, dp, check),
                True,
                lambda: self._release_stage(staging),
            )

        def prepare() -> None:
            self._release_in_place()
            self._fit(staging, groups, dtype)
            if in_place is not None:
                in_place.note(named)

        return Packing(
            groups, lambda group, check: staging.pack(group, dtype, check), len(groups) == 1, prepare
        )

    def adapter_packing(self, named: Named, dtype: torch.dtype | None) -> Packing:
        """Over CUDA IPC, where every worker reports its GPUs: into the adapters' own staging
        buffers (made, or replaced by larger ones, in ``prepare``), which every engine rank
        maps once; else a bucket of its own."""
        staging = self._adapter_staging
        if staging is None:
            return pack_with(self.facts, [named], dtype)
        return Packing(
            [named],
            lambda group, check: staging.pack(group, dtype, check),
            True,
            lambda: self._fit(staging, [named], dtype),
        )

    def _fit(self, staging: RefitStaging, groups: list[Named], dtype: torch.dtype | None) -> None:
        """Make ``staging``'s buffers hold the largest of ``groups`` on every engine GPU (the
        engines let go of smaller ones first)."""
        need = max(flat_sizes(groups, dtype), default=0)
        devices = sorted(set(self.facts.devices))
        if not staging.fits(devices, need):
            self._release_stage(staging)
            staging.allocate(devices, need)

    def _pickled(self, bucket: WeightBucket, engine: int) -> bytes:
        """What engine ``engine`` is sent of ``bucket``: its own pickle."""
        if bucket.layout and self._in_place is not None and self._in_place.holds(bucket):
            return self._in_place.pickled(engine)
        for staging in (self._staging, self._adapter_staging):
            if bucket.layout and staging is not None and staging.holds(bucket):
                return staging.pickled(bucket, self.replicas.info(engine)["devices"], engine)
        return pickle.dumps(bucket)

    # ---- applying -------------------------------------------------------------------------------
    def apply_bucket(self, bucket: WeightBucket, reset_prefix: bool) -> None:
        if self.channels:
            self.channels.send(bucket, self._pickled, self.group.call_timeout_s)
            if reset_prefix:
                self.reset_prefix_cache()
            return
        # the prefix reset in the same call
        args = [
            (bucket.layout, self._pickled(bucket, i), bucket.transport, reset_prefix)
            for i in range(len(self.replicas))
        ]
        refs, names = self.replicas.submit(EngineWorker.apply_bucket, args)
        try:
            self.group.get(refs, names=names)
        finally:
            if bucket.layout:  # after a failure, the next refit writes what others may still read
                ray.wait(refs, num_returns=len(refs), timeout=STAGED_WAIT_S)

    def apply_adapter(self, version: int, bucket: WeightBucket, drop: Sequence[int] = ()) -> None:
        """Every replica in service frees the versions ``drop`` and loads the adapter (over its
        ranks' channels, each between two of its engine's steps, else one call to its actor;
        its own pickle) before this returns; a copy is kept for a replacement (``adopt``), on
        the device the adapter was packed on (the trainer's GPU holds one per version held)."""
        for old in drop:
            self._adapters.pop(old, None)
        kept = bucket.copied()
        dropped = tuple(drop)
        if self.channels:
            self.channels.call(
                lambda i: LoadAdapter(version, self._pickled(bucket, i), dropped, bucket.layout),
                self.group.call_timeout_s,
            )
        else:
            args = [(version, self._pickled(bucket, i), dropped) for i in range(len(self.replicas))]
            refs, names = self.replicas.submit(EngineWorker.load_adapter, args)
            try:
                self.group.get(refs, names=names)
            finally:  # every load ended before a failed version is dropped from those that took it
                ray.wait(refs, num_returns=len(refs), timeout=STAGED_WAIT_S)
        self._adapters[version] = kept

    def drop_adapter(self, version: int) -> None:
        self._adapters.pop(version, None)
        if self.channels:
            self.channels.call(lambda i: DropAdapter(version), self.group.call_timeout_s)
        else:
            self.replicas.call(EngineWorker.drop_adapter, version)

    def reset_prefix_cache(self) -> None:
        self.replicas.call(EngineWorker.reset_prefix_cache)

    def clear_kv_cache(self) -> None:
        self.replicas.call(EngineWorker.clear_kv_cache)

    # ---- the weight-sync group ------------------------------------------------------------------
    def join_weight_sync(self, spec: SyncGroupSpec) -> Callable[[], None]:
        """Every replica joins (``Replicas.sync_members``), one not in service too."""
        replicas, ranks = self.replicas, self.ranks_per_engine
        members = replicas.sync_members(spec.timeout_s)
        args = [(spec, 1 + i * ranks) for i in range(len(replicas))]
        refs = self.group.submit(EngineWorker.join_weight_sync, args, list(members))

        def joined() -> None:
            self.group.get(refs, names=[replicas.names[i] for i in members])
            replicas.joined(members)

        return joined

    def receive_weights(self, spec: WeightSpec) -> Callable[[], bool]:
        """Every member of the group receives (``Replicas.sync_submit``: a stale one too)."""
        refs, names = self.replicas.sync_submit(EngineWorker.receive_weights, [(spec,)] * len(self.replicas))
        return lambda: self.group.get(refs, names=names)[0]

    # ---- replicas leaving and returning (``ReplicaListener``; ``rollgen.distributed.fleet``) ------
    def replica_left(self, engine: int) -> None:
        """Engine ``engine`` is out of service: its channels close (later updates skip it)."""
        if self.channels:
            channel.close([self.channels.channels[engine]])
            self.channels.channels[engine] = []

    def replica_returned(self, engine: int) -> None:
        """Engine ``engine`` is back in service (``adopt`` brought it up to date, or it received
        an update over the weight-sync group): connect its refit channels, where the others
        have theirs. The kept layouts start afresh on every engine (none holds a handle the
        returned one lacks)."""
        if not self.channels or self.channels.channels[engine]:
            return
        self.release()
        self.channels.forget()
        worker, name = self.group.workers[engine], self.group.names[engine]
        opening = worker.open_channels.remote(self._authkey, self.capacity)
        (addresses,) = self.group.get([opening], names=[name])
        opened = channel.connect([addresses], self._authkey, [name]) if addresses else []
        if opened:
            self.channels.channels[engine] = opened[0]
        else:  # an engine without channels: every update goes through the actors
            logger.warning("%s: %s opened no refit channel; refits go through the actors", self.name, name)
            self.channels.close()

    def give_adapters(self, engine: int) -> None:
        """Load every adapter version held into engine ``engine`` (out of service), through
        its actor."""
        worker, name = self.group.workers[engine], self.group.names[engine]
        host = transport_named(self.transport).host
        for version, kept in self._adapters.items():
            adapter = pickle.dumps(pack_bucket(kept.named(), host, check_finite=False))
            self.group.get([worker.load_adapter.remote(version, adapter)], names=[name])

    def adopt(self, engine: int, buckets: Iterable[WeightBucket]) -> None:
        """Bring the new engine ``engine`` (still out of service) to the current weights: load
        ``buckets`` (the last one resets its prefix cache) and every adapter version held
        through its actor (its channels connect once it returns). The kept layouts (staging
        buffers, tensors read in place) start afresh on every engine, so none holds a handle the
        new one lacks."""
        self.release()
        self.channels.forget()
        worker, name = self.group.workers[engine], self.group.names[engine]
        todo = list(buckets)
        for n, bucket in enumerate(todo, 1):
            ref = worker.apply_bucket.remote("", pickle.dumps(bucket), bucket.transport, n == len(todo))
            self.group.get([ref], names=[name])
        self.give_adapters(engine)

    # ---- what refits keep -------------------------------------------------------------------------
    def release(self) -> None:
        """Have the engines let go of the staging buffers (the adapters' too) and of the tensors
        read in place."""
        try:
            self._release_stage(self._staging)
        finally:
            try:
                self._release_stage(self._adapter_staging)
            finally:
                self._release_in_place()

    def _release_stage(self, staging: RefitStaging | None) -> None:
        """Have every engine let go of ``staging``'s buffers, then drop them."""
        if staging is not None:
            self._release_mapped(staging.keys, staging.release)

    def _release_in_place(self) -> None:
        """Have every engine let go of the trainer's tensors it reads in place, then forget them."""
        if self._in_place is not None and self._in_place.keys:
            try:
                self._release_mapped(self._in_place.keys, self._in_place.release)
            finally:
                torch.cuda.ipc_collect()  # what the trainer dropped meanwhile is freed now

    def _release_mapped(self, keys: list[str], release: Callable[[], None]) -> None:
        """Have every engine unmap ``keys``, then ``release`` them here (nothing runs on the
        engines: a refit's own, or shutdown's)."""
        if not keys:
            return
        self.channels.forget()  # the engines let go of what they unpacked too
        try:
            refs, names = self.replicas.submit(EngineWorker.release_staged, [(keys,)] * len(self.replicas))
            self.group.get(refs, timeout_s=STAGED_WAIT_S, names=names)
        finally:
            release()

    def close(self) -> None:
        """At shutdown, after ``release``: close the channels."""
        self.channels.close()

    def survives(self, error: WorkerError) -> bool:
        return error.died and self.replicas.died_as(error)
