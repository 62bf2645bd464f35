"""Sleep and wake: latency and the device memory released and retaken, rollgen (staged wake:
weights, then KV cache) beside the raw engine's own calls."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

from benchmarks.common import gpu_used_gib, timed

#: The columns of the printed table.
COLUMNS = ["engine", "sleep_s", "wake_s", "released_gib", "retaken_gib"]


def cycle(sleep: Callable[[], Any], wakes: Sequence[Callable[[], Any]], device: int) -> dict[str, float]:
    awake = gpu_used_gib(device)
    t_sleep = timed(sleep)
    asleep = gpu_used_gib(device)
    t_wakes = [timed(w) for w in wakes]
    back = gpu_used_gib(device)
    return {
        "sleep_s": t_sleep,
        "wake_s": sum(t_wakes),
        **{f"wake_{i}_s": t for i, t in enumerate(t_wakes)},
        "released_gib": awake - asleep,
        "retaken_gib": back - asleep,
    }


def measure(
    name: str, sleep: Callable[[], Any], wakes: Sequence[Callable[[], Any]], device: int, repeats: int
) -> dict[str, Any]:
    runs = [cycle(sleep, wakes, device) for _ in range(repeats)]
    row: dict[str, Any] = {"engine": name, "cycles": repeats}
    for key in runs[0]:
        row[key] = statistics.median(r[key] for r in runs)
    row["wake_s_max"] = max(r["wake_s"] for r in runs)
    return row


def measure_rollgen(gen: Any, device: int, repeats: int) -> dict[str, Any]:
    """rollgen's sleep, then its staged wake: weights (where a refit would go), then KV cache."""
    wakes = [
        partial(gen.prepare_for_generation, ["weights"]),
        partial(gen.prepare_for_generation, ["kv_cache"]),
    ]
    return measure("rollgen", gen.finish_generation, wakes, device, repeats)
