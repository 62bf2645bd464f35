"""The engine link: the few things a weight update asks of an engine (pack, apply a bucket, reset
the prefix cache, clear the KV cache, join and receive over a weight-sync group, release what
refits keep), and the default one for engines in this process, over the backend's hooks."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple, Protocol

import torch

from rollgen.errors import RefitError, WorkerError
from rollgen.refit.bucket import WeightBucket, pack_bucket
from rollgen.refit.meta import Named, TensorMeta, Transport, WeightSpec
from rollgen.refit.weight_sync import SyncGroup, SyncGroupSpec, receive

if TYPE_CHECKING:
    from rollgen.base import BaseGeneration


class Packing(NamedTuple):
    """How a ``refit`` packs: the buckets' groups of named tensors, and ``pack(group,
    check_finite)`` → bucket (checking the values after any cast, with ``check_finite``);
    ``checks``: packing checks every value before anything is sent, so ``refit`` need not read
    the source first; ``prepare``: what comes before the first bucket (with the engines idle)."""

    groups: list[Named]
    pack: Callable[[Named, bool], WeightBucket]
    checks: bool = False
    prepare: Callable[[], None] = lambda: None


def pack_with(
    transport: Transport, groups: list[Named], dtype: torch.dtype | None, devices: tuple[str, ...]
) -> Packing:
    """Packing over ``transport``, each bucket loaded before the next is packed.

    Args:
        transport: the engines' ``local_transport``.
        groups: the buckets' named tensors. dtype: the cast while packing.
        devices: the engine GPUs a ``cuda_ipc`` bucket gets a handle for (a source on one GPU
            reaches engines on others)."""
    return Packing(
        groups,
        lambda group, check: pack_bucket(
            group, transport, dtype=dtype, check_finite=check, devices=devices or None
        ),
    )


class EngineLink(Protocol):
    """What ``WeightUpdates`` asks of the engines. The engine facts (``engine_devices``,
    ``sync_device``, ``weight_sync_ranks``, ``in_process``) are the backend's."""

    @property
    def engine_devices(self) -> tuple[str, ...]: ...

    @property
    def sync_device(self) -> torch.device: ...

    @property
    def weight_sync_ranks(self) -> int: ...

    @property
    def in_process(self) -> bool: ...

    def packing(self, groups: list[Named], dtype: torch.dtype | None) -> Packing:
        """How a refit of ``groups`` (cast to ``dtype``) is packed for these engines."""
        ...

    def apply_bucket(self, bucket: WeightBucket, reset_prefix: bool) -> None:
        """Load one validated bucket; then drop every cached prefix, with ``reset_prefix``."""
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


class GenerationLink:
    """A link's engine facts, read off the generation it serves (the backend's)."""

    def __init__(self, generation: BaseGeneration) -> None:
        self._gen = generation

    @property
    def engine_devices(self) -> tuple[str, ...]:
        return self._gen.engine_devices

    @property
    def sync_device(self) -> torch.device:
        return self._gen.sync_device

    @property
    def weight_sync_ranks(self) -> int:
        return self._gen.weight_sync_ranks

    @property
    def in_process(self) -> bool:
        return self._gen.engines_in_process


class InProcessLink(GenerationLink):
    """The link to an engine in this process: the backend's ``_apply_bucket`` and its other
    hooks; a weight-sync group's engine end joins here, as rank 1."""

    def __init__(self, generation: BaseGeneration) -> None:
        super().__init__(generation)
        self._group: SyncGroup | None = None

    def packing(self, groups: list[Named], dtype: torch.dtype | None) -> Packing:
        return pack_with(self._gen.local_transport, groups, dtype, self.engine_devices)

    def apply_bucket(self, bucket: WeightBucket, reset_prefix: bool) -> None:
        self._gen._apply_bucket(bucket)
        if reset_prefix:
            self._gen._reset_prefix_cache()

    def reset_prefix_cache(self) -> None:
        self._gen._reset_prefix_cache()

    def clear_kv_cache(self) -> None:
        self._gen._clear_kv_cache()

    def survives(self, error: WorkerError) -> bool:
        return False

    def join_weight_sync(self, spec: SyncGroupSpec) -> Callable[[], None]:
        """The engine joins as rank 1 (returning once the sender has joined)."""
        self._group = SyncGroup(spec, 1, self.sync_device)
        return lambda: None

    def receive_weights(self, spec: WeightSpec) -> Callable[[], bool]:
        """Received here, each bucket through the backend's ``_apply_bucket``."""
        if self._group is None:
            raise RefitError(f"{self._gen.name}: no weight-sync group; call init_weight_sync first")
        partial = receive(
            self._group,
            spec,
            lambda named: self._gen._apply_bucket(
                WeightBucket("tensors", tuple(TensorMeta.of(n, t) for n, t in named), [t for _, t in named])
            ),
        )
        return lambda: partial

    def release(self) -> None:
        """Nothing is kept between refits in process."""

    def close(self) -> None:
        self._group = None
