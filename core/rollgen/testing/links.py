"""``RecordingLink``: an engine link that records what a weight update asks of the engines and
passes it on, for tests that check an update's lifecycle at the link (``gen.updates.link =
RecordingLink(gen.updates.link)``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rollgen.refit.bucket import WeightBucket
from rollgen.refit.link import EngineLink
from rollgen.refit.meta import WeightSpec
from rollgen.refit.transports.collective import SyncGroupSpec


class RecordingLink:
    """Passes every call on to ``inner``; ``calls`` lists them: ``("apply", layout,
    reset_prefix)``, ``("reset",)``, ``("clear",)``, ``("join",)``, ``("receive",)``,
    ``("release",)``, ``("close",)``."""

    def __init__(self, inner: EngineLink) -> None:
        self.inner = inner
        self.calls: list[tuple[Any, ...]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)  # the engine facts and packing, as they are

    def apply_bucket(self, bucket: WeightBucket, reset_prefix: bool) -> None:
        self.calls.append(("apply", bucket.layout, reset_prefix))
        self.inner.apply_bucket(bucket, reset_prefix)

    def reset_prefix_cache(self) -> None:
        self.calls.append(("reset",))
        self.inner.reset_prefix_cache()

    def clear_kv_cache(self) -> None:
        self.calls.append(("clear",))
        self.inner.clear_kv_cache()

    def join_weight_sync(self, spec: SyncGroupSpec) -> Callable[[], None]:
        self.calls.append(("join",))
        return self.inner.join_weight_sync(spec)

    def receive_weights(self, spec: WeightSpec) -> Callable[[], bool]:
        self.calls.append(("receive",))
        return self.inner.receive_weights(spec)

    def release(self) -> None:
        self.calls.append(("release",))
        self.inner.release()

    def close(self) -> None:
        self.calls.append(("close",))
        self.inner.close()
