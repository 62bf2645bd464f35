"""Shared plumbing of the benchmarks: alternating timed runs, summaries, results on disk."""

from __future__ import annotations

import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def alternate(
    fns: dict[str, Callable[[], Any]], repeats: int, warmup: int = 1
) -> dict[str, dict[str, float]]:
    """Time each function ``repeats`` times, interleaved (A B A B ...), after ``warmup`` rounds;
    median, min and max seconds per function."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    return {
        k: {"median_s": statistics.median(v), "min_s": min(v), "max_s": max(v), "runs": len(v)}
        for k, v in times.items()
    }


def write_results(name: str, rows: list[dict[str, Any]], out_dir: str = "out/benchmarks") -> Path:
    path = Path(out_dir) / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"benchmark": name, "machine": machine(), "rows": rows}, indent=2))
    return path


def print_table(rows: list[dict[str, Any]], columns: list[str]) -> None:
    widths = [max(len(c), *(len(_fmt(r[c])) for r in rows)) for c in columns]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    for r in rows:
        print("  ".join(_fmt(r[c]).rjust(w) for c, w in zip(columns, widths)))


def _fmt(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)
