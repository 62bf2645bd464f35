"""Data- and tensor-parallel scaling: the throughput of one rollgen layout on the batch, and
each layout's throughput relative to the first. Layouts run one after another: two cannot hold
the same GPUs at once."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from benchmarks.common import alternate


def measure(layout: str, generate: Callable[[], int], repeats: int) -> dict[str, Any]:
    """``generate`` runs the batch and returns its output tokens (its first, counting call is
    the warm-up)."""
    tokens = generate()
    t = alternate({layout: generate}, repeats=repeats, warmup=0)[layout]
    return {
        "layout": layout,
        "tokens": tokens,
        "tok_s": tokens / t["median_s"],
        "tok_s_min": tokens / t["max_s"],
        "tok_s_max": tokens / t["min_s"],
    }


def relative_to_first(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Adds ``vs_<first layout>``: each row's throughput over the first row's."""
    base = rows[0]
    return [{**r, f"vs_{base['layout']}": r["tok_s"] / base["tok_s"]} for r in rows]
