"""The engine link: the few things a weight update asks of an engine (pack, apply a bucket, load
and drop adapter versions, reset the prefix cache, clear the KV cache, join and receive over a
weight-sync group, release what refits keep), the facts it knows of the engines
(``EngineFacts``), and the link to an engine in this process, made from the backend's parts
(``InProcessLink``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

import torch

from rollgen.errors import RefitError, WorkerError
from rollgen.refit.bucket import WeightBucket, pack_bucket
from rollgen.refit.meta import Named, Transport, WeightSpec
from rollgen.refit.transports.collective import CollectiveReceiver, SyncGroupSpec


@dataclass(frozen=True)
class EngineFacts:
    """What weight updates know of the engines they reach.

    Args:
        transport: how ``refit()`` packs a local source for them (``rollgen.refit.transports``).
        devices: UUIDs of the GPUs their ranks run on (empty on CPU, or where unknown): CUDA IPC
            buckets are checked against them before anything is sent.
        sync_device: where they receive a weight-sync group's broadcasts (NCCL needs a GPU).
        sync_ranks: how many ranks they join a weight-sync group with (every TP rank of every
            replica).
        in_process: they run in this process (a weight-sync group's sender is then elsewhere).
        versioned_prefixes: their prefix caches key each prompt by the weight version it is
            decoded with (``SampleParams.weight_version``): no prefix cached under other weights
            is reused, so an update resets no prefix cache."""

    transport: Transport = "tensors"
    devices: tuple[str, ...] = ()
    sync_device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    sync_ranks: int = 1
    in_process: bool = True
    versioned_prefixes: bool = False


class Packing(NamedTuple):
    """How a ``refit`` packs: the buckets' groups of named tensors, and ``pack(group,
    check_finite)`` → bucket (checking the values after any cast, with ``check_finite``);
    ``checks``: packing checks every value before anything is sent, so ``refit`` need not read
    the source first; ``prepare``: what comes before the first bucket (with the engines idle)."""

    groups: list[Named]
    pack: Callable[[Named, bool], WeightBucket]
    checks: bool = False
    prepare: Callable[[], None] = lambda: None


def pack_with(facts: EngineFacts, groups: list[Named], dtype: torch.dtype | None) -> Packing:
    """Packing over the engines' transport, each bucket loaded before the next is packed.

    Args:
        facts: the engines' (a ``cuda_ipc`` bucket gets a handle for each of their GPUs: a
            source on one GPU reaches engines on others).
        groups: the buckets' named tensors. dtype: the cast while packing."""
    devices = facts.devices or None
    return Packing(
        groups,
        lambda group, check: pack_bucket(
            group, facts.transport, dtype=dtype, check_finite=check, devices=devices
        ),
    )


class EngineLink(Protocol):
    """What ``WeightUpdates`` asks of the engines, and what it knows of them (``facts``)."""

    @property
    def facts(self) -> EngineFacts: ...

    def packing(self, groups: list[Named], dtype: torch.dtype | None) -> Packing:
        """How a refit of ``groups`` (cast to ``dtype``) is packed for these engines."""
        ...

    def apply_bucket(self, bucket: WeightBucket, reset_prefix: bool) -> None:
        """Load one validated bucket; then drop every cached prefix, with ``reset_prefix``."""
        ...

    def adapter_packing(self, named: Named, dtype: torch.dtype | None) -> Packing:
        """How an adapter refit of ``named`` (cast to ``dtype``) is packed for these engines:
        one bucket, its ``prepare`` and ``pack`` run in the update (a bucket of its own each
        time, or staging kept for adapters)."""
        ...

    def apply_adapter(self, version: int, bucket: WeightBucket, drop: Sequence[int] = ()) -> None:
        """Free adapter versions ``drop``, then load a validated adapter (the whole of it, one
        bucket) as adapter ``version``, on every engine (one call to each for both); none serves
        it before this returns."""
        ...

    def drop_adapter(self, version: int) -> None:
        """Free adapter ``version`` on every engine (no sample decodes with it any more)."""
        ...

    def reset_prefix_cache(self) -> None: ...

    def clear_kv_cache(self) -> None: ...

    def join_weight_sync(self, spec: SyncGroupSpec) -> Callable[[], None]:
        """Start every engine rank joining ``spec``'s group; returns a wait for them."""
        ...

    def receive_weights(self, spec: WeightSpec) -> Callable[[], bool]:
        """Start every engine rank receiving one update; returns a wait saying if it was partial."""
        ...

    def release(self) -> None:
        """Free what refits keep between them (staging buffers, tensors read in place)."""
        ...

    def survives(self, error: WorkerError) -> bool:
        """Whether the engines left after ``error`` take the update again (a replica's death
        that a fleet with ``engine_failures: "replace"`` outlives)."""
        ...

    def close(self) -> None:
        """At shutdown: end what the link holds (after ``release``)."""
        ...


def _nothing() -> None:
    """An engine that caches no prefix has none to drop."""


class InProcessLink:
    """The link to an engine in this process, made from its parts: its ``facts``, and
    ``load(named)``, which copies validated named tensors into the engine (finishing before it
    returns: the trainer may write the next bucket into the same memory then);
    ``reset_prefix()`` drops every cached prefix (after an update that follows a generate);
    ``clear_kv()`` drops them and zeroes the KV cache (after outputs with NaN logprobs; None:
    ``reset_prefix``); with the ``adapters`` capability, ``load_adapter(version, named)`` and
    ``drop_adapter(version)``. A weight-sync group's engine end joins here, as rank 1."""

    def __init__(
        self,
        facts: EngineFacts,
        load: Callable[[Named], None],
        *,
        reset_prefix: Callable[[], None] = _nothing,
        clear_kv: Callable[[], None] | None = None,
        load_adapter: Callable[[int, Named], None] | None = None,
        drop_adapter: Callable[[int], None] | None = None,
    ) -> None:
        self.facts = facts
        self._load, self._reset_prefix = load, reset_prefix
        self._clear_kv = clear_kv or reset_prefix
        self._load_adapter, self._drop_adapter = load_adapter, drop_adapter
        self._receiver = CollectiveReceiver()

    def packing(self, groups: list[Named], dtype: torch.dtype | None) -> Packing:
        return pack_with(self.facts, groups, dtype)

    def apply_bucket(self, bucket: WeightBucket, reset_prefix: bool) -> None:
        self._load(bucket.unpack())
        if reset_prefix:
            self._reset_prefix()

    def adapter_packing(self, named: Named, dtype: torch.dtype | None) -> Packing:
        return pack_with(self.facts, [named], dtype)

    def apply_adapter(self, version: int, bucket: WeightBucket, drop: Sequence[int] = ()) -> None:
        if self._load_adapter is None:
            raise RefitError("this engine was linked without adapters (InProcessLink(..., load_adapter=))")
        for old in drop:
            self.drop_adapter(old)
        self._load_adapter(version, bucket.unpack())

    def drop_adapter(self, version: int) -> None:
        if self._drop_adapter is not None:
            self._drop_adapter(version)

    def reset_prefix_cache(self) -> None:
        self._reset_prefix()

    def clear_kv_cache(self) -> None:
        self._clear_kv()

    def survives(self, error: WorkerError) -> bool:
        return False

    def join_weight_sync(self, spec: SyncGroupSpec) -> Callable[[], None]:
        """The engine joins as rank 1 (returning once the sender has joined)."""
        self._receiver.join(spec, 1, self.facts.sync_device)
        return lambda: None

    def receive_weights(self, spec: WeightSpec) -> Callable[[], bool]:
        """Received here, each bucket's tensors through ``load``."""
        if not self._receiver.joined:
            raise RefitError("no weight-sync group; call init_weight_sync first")
        partial = self._receiver.receive(spec, self._load)
        return lambda: partial

    def release(self) -> None:
        """Nothing is kept between refits in process."""

    def close(self) -> None:
        self._receiver.leave()
