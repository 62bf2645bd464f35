"""Data- and tensor-parallel scaling: rollgen engines of several layouts on the same batch,
alternating; throughput relative to the first layout."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from benchmarks.common import alternate


def measure(layouts: dict[str, Callable[[], int]], repeats: int) -> list[dict[str, Any]]:
    """``layouts``: name -> a generate call returning its output tokens; the first is the base."""
    tokens = {k: fn() for k, fn in layouts.items()}
    t = alternate(layouts, repeats=repeats, warmup=0)  # the counting call warmed up
    base = next(iter(layouts))
    base_tps = tokens[base] / t[base]["median_s"]
    return [
        {
            "layout": k,
            "tokens": tokens[k],
            "tok_s": tokens[k] / t[k]["median_s"],
            "tok_s_min": tokens[k] / t[k]["max_s"],
            "tok_s_max": tokens[k] / t[k]["min_s"],
            "vs_" + base: tokens[k] / t[k]["median_s"] / base_tps,
        }
        for k in layouts
    ]
