"""Comparing CPU profiles of engines' step loops, as the benchmarks' vLLM worker extension
(``benchmarks.vllm_ext``) returns them (profiled seconds and the top functions by their own
time)."""

from __future__ import annotations

import cProfile
import statistics
from typing import Any


def stats(profiler: cProfile.Profile, top: int) -> dict[str, Any]:
    """A stopped profile as the benchmarks keep it: the profiled seconds and the ``top``
    functions by their own time."""
    entries = profiler.getstats()
    top_entries = sorted(entries, key=lambda e: e.inlinetime, reverse=True)[:top]
    return {
        "profiled_s": sum(e.inlinetime for e in entries),
        "top": [
            {"function": where(e.code), "calls": e.callcount, "own_s": e.inlinetime} for e in top_entries
        ],
    }


def where(code: Any) -> str:
    """A profiled function as ``file.py:line(name)`` (built-ins as cProfile names them)."""
    if isinstance(code, str):
        return code
    return f"{code.co_filename.rsplit('/', 1)[-1]}:{code.co_firstlineno}({code.co_name})"


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over profiled runs: wall and profiled seconds per generate, and each function's
    own seconds over the runs whose top list has it, largest first."""
    by_run = [{f["function"]: f["own_s"] for f in run["top"]} for run in runs]
    own = {n: statistics.median(r[n] for r in by_run if n in r) for n in set().union(*by_run)}
    return {
        "runs": len(runs),
        "wall_s": statistics.median(r["wall_s"] for r in runs),
        "profiled_s": statistics.median(r["profiled_s"] for r in runs),
        "own_s": dict(sorted(own.items(), key=lambda kv: -kv[1])),
    }


def differences(base: dict[str, Any], other: dict[str, Any], top: int = 15) -> list[dict[str, Any]]:
    """The ``top`` functions whose median own time differs most between two ``summarize``
    results (``other`` minus ``base``, milliseconds per generate). Only functions in both: one
    missing from a side's top lists took less than that list's last entry, not nothing."""
    names = set(base["own_s"]) & set(other["own_s"])
    rows = [
        {"function": n, "base_ms": 1e3 * base["own_s"][n], "other_ms": 1e3 * other["own_s"][n]} for n in names
    ]
    for r in rows:
        r["diff_ms"] = r["other_ms"] - r["base_ms"]
    return sorted(rows, key=lambda r: -abs(r["diff_ms"]))[:top]
