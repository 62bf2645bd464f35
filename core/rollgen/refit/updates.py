"""``WeightUpdates``: one generation's weight updates from validation to settlement — the checks
against the served model (kept for the layout a trainer refits every step), adapter versions, the buckets, the
finiteness check, streamed samples in flight per the update's mode, staleness after a failure
part-way, a KV cache poisoned by NaN weights, the prefix-cache reset, and the roles in a
weight-sync group. It talks down only, to an engine link (``rollgen.refit.link``)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, cast

import torch

from rollgen.errors import RefitError, StaleWeights, UnsupportedCapability, WorkerError
from rollgen.refit.adapters import AdapterSpec, AdapterVersions, adapter_tensors
from rollgen.refit.bucket import WeightBucket, default_bucket_bytes, grouped, named_tensors
from rollgen.refit.checks import (
    check_against_spec,
    check_bucket_bytes,
    check_dtype,
    check_reach,
    check_readable,
    check_source,
    require_finite,
)
from rollgen.refit.link import EngineFacts, EngineLink, Packing
from rollgen.refit.meta import Named, TensorMeta, WeightSpec
from rollgen.refit.transports.collective import SyncBackend, SyncGroupSpec, WeightSender
from rollgen.refit.transports.cuda_ipc import device_uuid

if TYPE_CHECKING:
    from rollgen.rollout import Streams, UpdateMode

logger = logging.getLogger(__name__)


def layout_of(named: Named, *settings: Any) -> tuple[Any, ...]:
    """What a source's checks against the served model depend on: ``settings`` (the cast, ...)
    and each tensor's name, shape and dtype (a trainer refits the same layout every step)."""
    return (*settings, tuple((n, t.shape, t.dtype) for n, t in named))


class WeightUpdates:
    """One generation's weight updates, from validation to settlement.

    Args:
        name: the generation's (backend's) name, for messages.
        expected: reads the served model's ``WeightSpec`` (called once).
        streams: the streamed samples an update may meet in flight.
        lora: the config's LoRA setup (None: no adapters).

    ``link``: how updates reach the engines (``rollgen.refit.link.EngineLink``; None: a backend
    without refit). ``expected`` may be replaced before the first update. The generation's lock
    is held around every method."""

    def __init__(
        self,
        name: str,
        expected: Callable[[], WeightSpec],
        streams: Streams,
        lora: Mapping[str, Any] | None = None,
    ) -> None:
        self.name, self.expected, self._streams, self._lora = name, expected, streams, lora
        self.link: EngineLink | None = None
        #: Told of each update that completed: its named tensors (lazily, as applied) or None
        #: (it came over a weight-sync group), and whether it was partial.
        self._listeners: list[Callable[[Iterable[tuple[str, torch.Tensor]] | None, bool], None]] = []
        self._spec: WeightSpec | None = None
        #: Why the engine may hold mixed weights (an update failed part-way), until a complete one.
        self.stale: str | None = None
        #: Whether the engine may hold cached prefixes: a generate ran since the last reset (a
        #: sleep resets too). An update resets the prefix cache only then, and only where the
        #: engines do not key prefixes by weight version (``EngineFacts.versioned_prefixes``).
        self.prefixes_cached = False
        #: A generate returned non-finite logprobs: the KV cache may hold NaNs, which the next
        #: complete update clears.
        self.kv_poisoned = False
        #: The layout of the last refit source that passed the checks, and its buckets (by index
        #: into its tensors) for a bucket size: a trainer refits the same layout each step.
        self._checked_layout: tuple[Any, ...] | None = None
        self._groups: tuple[Any, list[list[int]]] = (None, [])
        #: The bucket size of refits that give none, set by the first of them (a quarter of the
        #: source GPU's free memory then): every later one has the same buckets.
        self._default_bucket_bytes: int | None = None
        #: The weight-sync group (``init_weight_sync``), and its sender when it is this process.
        self.weight_sync: SyncGroupSpec | None = None
        self._sender: WeightSender | None = None
        #: The adapter versions the engines hold (None: no ``lora`` in the config).
        self.adapters = None if lora is None else AdapterVersions(lora["max_versions"])
        self._adapter_spec: AdapterSpec | None = None
        #: The layout of the last adapter that passed the checks against ``adapter_spec``.
        self._checked_adapter: tuple[Any, ...] | None = None

    @property
    def spec(self) -> WeightSpec:
        """What an update may send: HF checkpoint names, full (unsharded) shapes, engine dtype."""
        if self._spec is None:
            self._spec = self.expected()
        return self._spec

    @property
    def adapter_spec(self) -> AdapterSpec:
        """What an adapter refit sends (PEFT's names, the config's rank, the engine's dtype)."""
        lora = self._lora
        if lora is None:
            raise RefitError(f"{self.name}: no adapters; name a LoRA setup in the config's lora to refit one")
        if self._adapter_spec is None:
            self._adapter_spec = AdapterSpec.of(lora, self.spec)
        return self._adapter_spec

    @property
    def facts(self) -> EngineFacts:
        """What the link knows of the engines (the defaults where there is no link)."""
        return EngineFacts() if self.link is None else self.link.facts

    @property
    def _engines(self) -> EngineLink:
        if self.link is None:
            raise UnsupportedCapability(self.name, "refit", "weight updates (the backend links no engine)")
        return self.link

    def on_update(self, listener: Callable[[Iterable[tuple[str, torch.Tensor]] | None, bool], None]) -> None:
        """Tell ``listener(named, partial)`` of each update that completes, once the samples in
        flight are settled: ``named``, its tensors (an iterable read only if the listener reads
        it), or None for an update over a weight-sync group; an adapter update is a partial one
        of no tensor of the model."""
        self._listeners.append(listener)

    def _updated(self, named: Iterable[tuple[str, torch.Tensor]] | None, partial: bool) -> None:
        for listener in self._listeners:
            listener(named, partial)

    def check(self, metas: Iterable[TensorMeta], partial: bool = False) -> None:
        """Check tensors against the served model (``checks.check_against_spec``).

        Raises:
            RefitError: listing every mismatch, and what of the model they leave out
                (``partial``: of the module groups they send)."""
        check_against_spec(metas, self.spec, partial)

    # ---- updates from this process ------------------------------------------------------------
    def apply_buckets(self, buckets: list[WeightBucket], partial: bool, mode: UpdateMode) -> None:
        """Apply packed ``buckets``, with the samples in flight handled per ``mode``.

        Raises:
            RefitError: before anything is applied, for buckets that do not match the served
                model (``partial``: whole module groups of it) or do not reach every engine GPU.

        A failure after the first bucket reached the engines marks the generation stale."""
        self.check((m for b in buckets for m in b.metas), partial)
        link = self._engines
        for b in buckets:
            check_reach(b, link.facts.devices)
            b.resolve()  # mapped here once: each engine gets its own pickle, and it is read after
        with self._in_flight(mode):
            self._surviving(
                lambda: self._apply(
                    buckets, len(buckets), partial, f"update_weights of {len(buckets)} bucket(s)"
                )
            )
        self._updated((pair for b in buckets for pair in b.unpack()), partial)

    def refit(
        self,
        source: torch.nn.Module | Mapping[str, torch.Tensor],
        bucket_bytes: int | None,
        dtype: torch.dtype | None,
        partial: bool,
        check_finite: bool,
        mode: UpdateMode,
    ) -> None:
        """Validate ``source``, then pack and apply it, or broadcast it when this process is the
        group's sender.

        Args:
            source, bucket_bytes, dtype, partial, check_finite, mode: as
                ``BaseGeneration.refit``'s.

        Raises:
            RefitError: as ``BaseGeneration.refit`` says.

        The checks against the served model are kept for the layout a trainer refits every step
        (names, shapes, dtypes, the cast), and so are its buckets."""
        check_source(source)
        check_bucket_bytes(bucket_bytes)
        check_dtype(dtype)
        named = list(named_tensors(source))
        check_readable(named)
        layout = layout_of(named, dtype, partial)
        if layout != self._checked_layout:  # a trainer refits the same layout every step
            self.check((TensorMeta.of(n, t, dtype) for n, t in named), partial)
            self._checked_layout = layout
        sender, link = self._sender, self._engines
        packing = (
            None
            if sender is not None
            else link.packing(self._bucket_groups(named, bucket_bytes, dtype), dtype)
        )
        # where packing checks every value before anything is sent (and no sample in flight
        # would be touched first), it checks the packed bytes: one pass fewer over the source
        packed_check = check_finite and not self._streams.in_flight and packing is not None and packing.checks
        if check_finite and not packed_check:
            require_finite(named)
        # the source was checked; a cast to a narrower dtype may still overflow
        cast_check = packed_check or (check_finite and dtype is not None)

        def attempt(packing: Packing | None) -> None:
            if sender is not None:
                self._over_sync(
                    lambda: sender.send(
                        source,
                        bucket_bytes=bucket_bytes,
                        dtype=dtype,
                        partial=partial,
                        check_finite=cast_check,
                    )
                )
            elif packing is not None:
                packing.prepare()
                buckets = (packing.pack(group, cast_check) for group in packing.groups)
                self._apply(buckets, len(packing.groups), partial, "refit")

        with self._in_flight(mode):
            self._surviving(
                lambda: attempt(packing),
                # packed again for the engines left: a dead one's buffers are gone with it
                lambda: attempt(packing and link.packing(packing.groups, dtype)),
            )
        self._updated(((n, t if dtype is None else t.to(dtype)) for n, t in named), partial)

    # ---- adapters -------------------------------------------------------------------------------
    def refit_adapter(
        self, source: Any, dtype: torch.dtype | None, check_finite: bool, mode: UpdateMode
    ) -> None:
        """Validate an adapter (a PEFT model or its state dict), then load it as a new version.

        Raises:
            RefitError: before anything is applied, for an adapter that does not match the
                engine's adapter spec or holds non-finite values, or no room for a version."""
        named = adapter_tensors(source)
        check_dtype(dtype)
        check_readable(named)
        layout = layout_of(named, dtype)
        if layout != self._checked_adapter:  # a trainer refits the same adapter layout every step
            check_against_spec(
                (TensorMeta.of(n, t, dtype) for n, t in named), self.adapter_spec.weights, adapter=True
            )
            self._checked_adapter = layout
        if check_finite:  # before any sample in flight is touched
            require_finite(named)
        cast_check = check_finite and dtype is not None  # a cast to a narrower dtype may overflow

        def pack() -> WeightBucket:
            packing = self._engines.adapter_packing(named, dtype)  # for the engines there are now
            packing.prepare()
            return packing.pack(named, cast_check)

        self._apply_adapter(pack, mode)

    def apply_adapter_bucket(self, bucket: WeightBucket, mode: UpdateMode) -> None:
        """Load an adapter packed elsewhere (one bucket, checked there for non-finite values)."""
        check_against_spec(bucket.metas, self.adapter_spec.weights, adapter=True)
        check_reach(bucket, self._engines.facts.devices)
        bucket.resolve()
        self._apply_adapter(lambda: bucket, mode)

    def _apply_adapter(self, pack: Callable[[], WeightBucket], mode: UpdateMode) -> None:
        """Load the bucket ``pack()`` makes as a new adapter version on every engine (where
        one dies and the others survive it, packed again for those); samples started from then
        on decode with it. Under ``keep`` samples in flight finish on their version (it stays
        held); a version that failed to load on some engine is dropped from all, as is the one
        freed for it."""
        link, streams = self._engines, self._streams
        # both callers checked the adapter against adapter_spec, which needs the config's lora
        versions = cast(AdapterVersions, self.adapters)
        with streams.update(mode, fresh=lambda: self.stale is None, interrupt=mode != "keep"):
            dropped = versions.to_drop(streams.adapters_in_use())
            for old in dropped:
                versions.held.remove(old)
            versions.last += 1
            try:  # the oldest version freed in the same call to each engine
                self._surviving(lambda: link.apply_adapter(versions.last, pack(), dropped))
            except BaseException:  # those dropped are gone from rollgen's count: gone from every engine
                for version in (*dropped, versions.last):
                    self._drop_quietly(version)
                raise
            versions.added(versions.last)
            streams.adapter = versions.last
        self._updated((), partial=True)  # the model's weights are as they were

    def _drop_quietly(self, version: int) -> None:
        """Drop an adapter version from every engine after a failed load (it failed to load,
        or was to be freed by the call that failed)."""
        try:
            self._engines.drop_adapter(version)
        except Exception as exc:  # noqa: BLE001 - the load's error is the one raised
            logger.warning(
                "%s: adapter version %d, which failed to load, was not dropped: %r", self.name, version, exc
            )

    def _bucket_groups(
        self, named: Named, bucket_bytes: int | None, dtype: torch.dtype | None
    ) -> list[Named]:
        """The buckets a refit packs ``named`` in (kept for the layout and bucket size)."""
        size = bucket_bytes or self._default_bucket_bytes
        if size is None:
            size = self._default_bucket_bytes = default_bucket_bytes(dict(named))
        key = (self._checked_layout, size)
        if self._groups[0] != key:
            self._groups = (key, list(grouped(named, size, dtype)))
        return [[named[i] for i in group] for group in self._groups[1]]

    def _apply(self, buckets: Iterable[WeightBucket], count: int, partial: bool, what: str) -> None:
        """Load ``count`` validated buckets one at a time (each loaded before the next is
        packed), the last with the prefix-cache reset a generate since the last reset calls for.
        A failure after the first bucket reached the engine marks the generation stale."""
        applied, link = 0, self._engines
        try:
            for bucket in buckets:
                check_reach(bucket, link.facts.devices)
                applied += 1
                last = applied == count and self._resets_prefixes() and not self.kv_poisoned
                link.apply_bucket(bucket, reset_prefix=last)
                if last:
                    self.prefixes_cached = False
                del bucket
        except BaseException as exc:
            if applied:
                self._mark_stale(f"{what} failed at bucket {applied} ({type(exc).__name__}: {exc})")
            raise
        self._settle(partial)

    # ---- the weight-sync group ------------------------------------------------------------------
    def sync_spec(
        self, address: str, port: int, backend: SyncBackend | None, timeout_s: float
    ) -> SyncGroupSpec:
        """The spec of a group of the sender and every engine rank.

        Args:
            address, port, timeout_s: as ``SyncGroupSpec``'s.
            backend: None: NCCL if the engines receive on GPUs, else gloo.

        Raises:
            RefitError: for an invalid spec."""
        facts = self._engines.facts
        if backend is None:
            backend = "nccl" if facts.sync_device.type == "cuda" else "gloo"
        return SyncGroupSpec(address, port, 1 + facts.sync_ranks, backend, timeout_s)

    def init_weight_sync(self, spec: SyncGroupSpec, local_sender: bool) -> None:
        """Have every engine rank join ``spec``'s group (``BaseGeneration.init_weight_sync``).

        Args:
            spec: the sender's spec. local_sender: this process is the sender.

        Raises:
            RefitError: a spec with port 0 from another sender, a world size these engines do not
                have, a local sender for an engine in this process, an NCCL group whose ranks
                would share a GPU."""
        if spec.port == 0 and not local_sender:
            raise RefitError(
                "the spec's port is 0: pass the sender's spec (rollgen.WeightSender(spec).spec), which "
                "has the port it listens on"
            )
        link = self._engines
        ranks = link.facts.sync_ranks
        if spec.world_size != 1 + ranks:
            raise RefitError(
                f"{self.name}: the group has {spec.world_size} ranks; these engines need 1 + {ranks} "
                "(make the spec with weight_sync_spec)"
            )
        if local_sender and link.facts.in_process:
            raise RefitError(
                f"{self.name} runs its engine in this process: refit() here copies the weights directly; "
                "a weight-sync group is for a trainer in another process (local_sender=False)"
            )
        if spec.backend == "nccl":
            self._check_nccl_devices(local_sender)
        sender = None
        if local_sender:
            sender = WeightSender(spec)  # hosts the group's store (port 0: a free one) at once
            spec = sender.spec
        joined = link.join_weight_sync(spec)
        if sender is not None:
            sender.connect()
        joined()
        self.weight_sync, self._sender = spec, sender

    def _check_nccl_devices(self, local_sender: bool) -> None:
        """RefitError unless every rank of an NCCL group would have a GPU of its own (NCCL
        refuses, or hangs on, two ranks of one group on one GPU)."""
        facts = self._engines.facts
        if facts.sync_device.type != "cuda":
            raise RefitError(
                f"{self.name}: an NCCL weight-sync group needs the engines on CUDA GPUs; they receive on "
                f"{facts.sync_device}: use backend='gloo' (weight_sync_spec picks it for you)"
            )
        devices = list(facts.devices)
        if local_sender and torch.cuda.is_available():
            devices.append(device_uuid())
        shared = sorted({d for d in devices if devices.count(d) > 1})
        if shared:
            raise RefitError(
                f"{self.name}: an NCCL weight-sync group needs a GPU per rank, but GPU(s) {shared} would "
                "hold two (an engine rank and the sender, or two engines sharing a GPU). Colocated: "
                "refit() over CUDA IPC, without a group; else backend='gloo' or other GPUs"
            )

    def update_from_collective(self, mode: UpdateMode) -> None:
        """Receive the update the trainer's ``WeightSender.send`` broadcasts.

        Raises:
            RefitError: no group, or this process is its sender; and what ``collective.receive``
                raises (a failure while applying marks the generation stale)."""
        if self.weight_sync is None:
            raise RefitError(f"{self.name}: no weight-sync group; call init_weight_sync first")
        if self._sender is not None:
            raise RefitError(f"{self.name}: this process is the group's sender; call refit(source)")
        with self._in_flight(mode):
            self._surviving(lambda: self._over_sync(None))
        self._updated(None, partial=False)

    def _over_sync(self, send: Callable[[], None] | None) -> None:
        """Receive one update on every engine rank while ``send`` (if any) broadcasts it here."""
        try:
            received = self._engines.receive_weights(self.spec)
            if send is not None:
                sent = False
                try:
                    send()
                    sent = True
                finally:
                    if not sent:  # the engines end the update too, raising the sender's error or their own
                        try:
                            received()
                        except Exception as engines:  # noqa: BLE001 - the sender's error is the one raised
                            logger.debug("%s: the engines' side of the failed update: %r", self.name, engines)
            partial = received()
        except BaseException as exc:
            if not (isinstance(exc, RefitError) and not exc.stale):  # anything but a clean rejection
                self._mark_stale(f"an update over the weight-sync group failed ({type(exc).__name__}: {exc})")
            raise
        self._settle(partial)

    def require_fresh(self) -> None:
        """Check that the engine holds no mix of old and new weights.

        Raises:
            StaleWeights: an update failed part-way and no complete one followed."""
        if self.stale is not None:
            raise StaleWeights(
                f"{self.name}: {self.stale}; the engine may hold a mix of old and new weights. "
                "Call refit() (or update_weights()) with the complete weights, or send a complete "
                "update over a weight-sync group, before generating"
            )

    # ---- what the engine did between updates ----------------------------------------------------
    def generated(self) -> None:
        """A generate or a submit ran (or began): the engine may hold cached prefixes."""
        self.prefixes_cached = True

    def slept(self) -> None:
        """The engine slept, which resets its prefix cache."""
        self.prefixes_cached = False

    def nonfinite_logprobs(self) -> None:
        """An output held NaN or infinite logprobs: the next complete update clears the KV cache."""
        self.kv_poisoned = True
        logger.warning("%s: NaN or infinite logprobs; are the weights finite?", self.name)

    # ---- settlement -----------------------------------------------------------------------------
    def _in_flight(self, mode: UpdateMode) -> AbstractContextManager[None]:
        """Around an update's application: streamed samples in flight handled per ``mode``."""
        return self._streams.update(mode, fresh=lambda: self.stale is None)

    def _surviving(self, attempt: Callable[[], None], again: Callable[[], None] | None = None) -> None:
        """``attempt`` the update; where an engine's death ends it and the others survive it
        (``link.survives``), update those once more (``again``, or ``attempt``), inside the
        same handling of the samples in flight: a ``keep`` update's held samples continue
        under the new version, and no engine left serves mixed weights."""
        try:
            attempt()
        except WorkerError as exc:
            if not self._engines.survives(exc):
                raise
            logger.warning(
                "%s: %s died during a weight update; updating the others again", self.name, exc.worker
            )
            (again or attempt)()

    def _mark_stale(self, why: str) -> None:
        self.stale = why
        logger.error("%s: %s; generation is stale until a complete refit", self.name, why)

    def _settle(self, partial: bool) -> None:
        """A complete update clears staleness (and a KV cache poisoned by NaN weights); any
        update invalidates cached prefixes."""
        if not partial:
            self.stale = None
        if self.kv_poisoned and not partial:
            self._engines.clear_kv_cache()
            self.kv_poisoned = self.prefixes_cached = False
        if self._resets_prefixes():
            self._engines.reset_prefix_cache()
            self.prefixes_cached = False

    def _resets_prefixes(self) -> bool:
        """Whether an update resets the prefix cache: a generate may have filled it since the
        last reset, and the engines would reuse its prefixes under new weights."""
        return self.prefixes_cached and not self._engines.facts.versioned_prefixes

    def release(self) -> None:
        """Have the engines free what refits keep between them (``release_refit_buffers``)."""
        if self.link is not None:
            self.link.release()

    def close(self) -> None:
        """At shutdown: forget the group; the link ends what it holds."""
        self._sender = None
        if self.link is not None:
            self.link.close()
