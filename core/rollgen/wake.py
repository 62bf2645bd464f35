"""Which parts of an engine are on its device: ``prepare_for_generation`` wakes them,
``finish_generation`` puts them all to sleep."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from rollgen.errors import EngineAsleep, InputError

#: What ``prepare_for_generation`` wakes, in the order it wakes them.
WAKE_TAGS = ("weights", "kv_cache")


class WakeState:
    """The tags awake now: every one at creation."""

    def __init__(self) -> None:
        self._awake = set(WAKE_TAGS)

    @property
    def all_awake(self) -> bool:
        return self._awake >= set(WAKE_TAGS)

    @property
    def any_awake(self) -> bool:
        return bool(self._awake)

    def require(self, tags: Iterable[str], what: str) -> None:
        """EngineAsleep (saying ``what`` cannot run) unless every tag of ``tags`` is awake."""
        asleep = [t for t in tags if t not in self._awake]
        if asleep:
            raise EngineAsleep(f"cannot {what}: {', '.join(asleep)} asleep; call prepare_for_generation()")

    def asleep(self, tags: Sequence[str] | None) -> list[str]:
        """The tags of ``tags`` (None: all) that are asleep, in waking order. InputError for a
        tag that is not one of ``WAKE_TAGS``."""
        wanted = list(WAKE_TAGS if tags is None else tags)
        unknown = [t for t in wanted if t not in WAKE_TAGS]
        if unknown:
            raise InputError(f"unknown wake tags {unknown}; use {list(WAKE_TAGS)}")
        return [t for t in WAKE_TAGS if t in wanted and t not in self._awake]

    def woke(self, tags: Iterable[str]) -> None:
        self._awake.update(tags)

    def slept(self) -> None:
        self._awake.clear()
