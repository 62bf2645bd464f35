"""``ProbeWorker``: a real Ray actor that reports where it runs and can be told to fail or die.

It stands in for an engine only to inject faults a real engine cannot be made to produce on
demand (a crash, a dead process); it claims no engine behaviour.
"""

from __future__ import annotations

import os
import threading
from typing import Any

from rollgen.distributed.worker_groups import TiedGroup
from rollgen.errors import InputError


class ProbeWorker:
    def __init__(self, tag: str, group: TiedGroup, index: int) -> None:
        self.tag, self.group, self.index = tag, group, index

    def where(self) -> dict[str, Any]:
        import ray

        ctx = ray.get_runtime_context()
        return {"node": ctx.get_node_id(), "bundles": self.group.bundle_indices, "index": self.index}

    def echo(self, shard: Any) -> Any:
        return shard

    def fail(self) -> None:
        raise ZeroDivisionError("probe asked to fail")

    def fail_typed(self) -> None:
        raise InputError("typed error from a worker", [3])

    def block(self) -> None:
        """Never returns (a worker stuck in a long call)."""
        threading.Event().wait()

    def die(self) -> None:
        os._exit(1)

    def shutdown(self) -> None:
        return None
