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


class StartCounter:
    """A named actor the probes of one test report their starts to: how many were starting at
    once, at most."""

    def __init__(self) -> None:
        self.starting = self.most = 0
        self.started: list[Any] = []

    def enter(self) -> None:
        self.starting += 1
        self.most = max(self.most, self.starting)

    def leave(self) -> None:
        self.starting -= 1

    def most_at_once(self) -> int:
        return self.most

    def note(self, handle: Any) -> None:
        """Keep the handle of a probe that started."""
        self.started.append(handle)

    def handles(self) -> list[Any]:
        return self.started


class ProbeWorker:
    """``tag`` "starts:NAME": the start reports to the ``StartCounter`` actor NAME and takes a
    while (as an engine's does); "fail-start:NAME": index 0 leaves its handle with that actor,
    and the start of index 1 raises."""

    def __init__(self, tag: str, group: TiedGroup, index: int) -> None:
        self.tag, self.group, self.index = tag, group, index
        if tag.startswith("starts:"):
            import ray

            counter = ray.get_actor(tag.removeprefix("starts:"))
            ray.get(counter.enter.remote())
            threading.Event().wait(0.5)
            ray.get(counter.leave.remote())
        if tag.startswith("fail-start:"):
            import ray

            if index == 1:
                raise RuntimeError("probe asked to fail its start")
            counter = ray.get_actor(tag.removeprefix("fail-start:"))
            ray.get(counter.note.remote(ray.get_runtime_context().current_actor))

    def where(self) -> dict[str, Any]:
        import ray

        ctx = ray.get_runtime_context()
        return {"node": ctx.get_node_id(), "bundles": self.group.bundle_indices, "index": self.index}

    def ready(self) -> dict[str, Any]:
        """What an engine reports once started (``EngineWorker.ready``), of this probe."""
        return {**self.where(), "pid": os.getpid(), "devices": [], "capacity": 1}

    def generate(self, request: Any) -> Any:
        """The shard's prompts, as they came (an ``EngineWorker.generate`` call, echoed)."""
        return request.input_ids

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
