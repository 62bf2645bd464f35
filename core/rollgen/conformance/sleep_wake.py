"""Sleep and wake: idempotent, staged (weights, then KV cache), memory released where claimed."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from rollgen.conformance.checks import (
    assert_same_tokens,
    can_refit,
    device_memory_used,
    raises,
    requires,
    skip_unless,
)
from rollgen.errors import EngineAsleep
from rollgen.spec import Capability


class SleepWakeTests:
    """Sleep and wake of the shared engine, which ends the test awake."""

    @requires("sleep_wake")
    def test_sleep_wake(
        self,
        engine: Any,
        caps: frozenset[Capability],
        references: Callable[[str, str], Any],
        model_dir: str,
        batch: dict[str, torch.Tensor],
        greedy_out: dict[str, torch.Tensor],
    ) -> None:
        skip_unless(caps, "sleep_wake", engine.finish_generation)
        before = device_memory_used()
        engine.finish_generation()
        engine.finish_generation()  # idempotent
        if engine.releases_memory_on_sleep:
            after = device_memory_used()
            assert after < before, (
                f"device memory in use: {after} bytes asleep, {before} awake: sleep should free some"
            )
        raises(EngineAsleep, "generate while asleep", lambda: engine.generate(batch, greedy=True))
        engine.prepare_for_generation(tags=["weights"])
        if can_refit(caps):  # the staged refit pattern: weights up, refit, then cache
            engine.refit(references(model_dir, "float32"), dtype=engine.engine_dtype)
        engine.prepare_for_generation(tags=["kv_cache"])
        engine.prepare_for_generation()  # idempotent
        out = engine.generate(batch, greedy=True)
        assert_same_tokens("after sleep and wake", out["output_ids"], greedy_out["output_ids"])
