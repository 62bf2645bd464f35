"""``KeptLayouts``: the bucket layouts kept between refits (a trainer refits the same layout every
step), the least recently used dropped first. One class on every end: the trainer's staging
buffers keep each layout's views and pickles, an engine rank keeps what it unpacked of each
(``rollgen.refit.receiver.Receiver``, its refit channel's), and the driver mirrors what each
engine holds (``rollgen.refit.channel.EngineChannels``), told the rank's capacity when it opens
the channels."""

from __future__ import annotations

from collections.abc import Hashable, Iterator
from typing import Generic, TypeVar

#: How many layouts each end keeps unless told otherwise.
KEPT_LAYOUTS = 8

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class KeptLayouts(Generic[K, V]):
    """At most ``capacity`` layouts (key → value), in order of use."""

    def __init__(self, capacity: int = KEPT_LAYOUTS) -> None:
        if capacity < 1:
            raise ValueError(f"KeptLayouts keeps at least one layout, got capacity={capacity}")
        self.capacity = capacity
        self._kept: dict[K, V] = {}

    def __contains__(self, key: K) -> bool:
        return key in self._kept

    def __len__(self) -> int:
        return len(self._kept)

    def __iter__(self) -> Iterator[K]:
        return iter(self._kept)

    def values(self) -> Iterator[V]:
        """The values kept, least recently used first (their order of use unchanged)."""
        return iter(self._kept.values())

    def get(self, key: K) -> V | None:
        """The value kept under ``key`` (now the most recently used), or None."""
        return self._kept[key] if self.use(key) else None

    def use(self, key: K) -> bool:
        """Mark ``key`` the most recently used; whether it is kept."""
        if key not in self._kept:
            return False
        self._kept[key] = self._kept.pop(key)
        return True

    def keep(self, key: K, value: V) -> list[tuple[K, V]]:
        """Keep ``value`` under ``key`` (the most recently used); returns what was dropped to
        make room (the least recently used)."""
        self._kept.pop(key, None)
        dropped = []
        while len(self._kept) >= self.capacity:
            oldest = next(iter(self._kept))
            dropped.append((oldest, self._kept.pop(oldest)))
        self._kept[key] = value
        return dropped

    def clear(self) -> None:
        self._kept.clear()
