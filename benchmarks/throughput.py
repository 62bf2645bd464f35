"""Generation throughput: rollgen against the raw engine on the same GPU and workload,
alternating, plus rollgen's own per-call work as a share of its generate time."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.common import alternate
from benchmarks.overhead import make_call, rollgen_call


def measure(name: str, contestants: dict[str, Callable[[], int]], repeats: int) -> dict[str, Any]:
    """Each contestant runs the same batch and returns the output tokens it produced (its first
    call, which counts them, is the warm-up); then they alternate. The first contestant is the
    baseline: each other's ``<name>_ratio`` is the median over rounds of its throughput over the
    baseline's in the same round (paired, so the GPU's drifts between rounds cancel); every
    round's seconds are kept (``<name>_times_s``)."""
    tokens = {k: fn() for k, fn in contestants.items()}
    t = alternate(contestants, repeats=repeats, warmup=0)
    base = next(iter(contestants))
    row: dict[str, Any] = {"mode": name, "repeats": repeats}
    for k in contestants:
        row[f"tokens_{k}"] = tokens[k]
        row[f"{k}_tok_s"] = tokens[k] / t[k]["median_s"]
        row[f"{k}_tok_s_min"] = tokens[k] / t[k]["max_s"]
        row[f"{k}_tok_s_max"] = tokens[k] / t[k]["min_s"]
        row[f"{k}_s"] = t[k]["median_s"]
        row[f"{k}_times_s"] = t[k]["times"]
        if k != base:
            row[f"{k}_ratio"] = statistics.median(
                paired_ratios(tokens[base], t[base]["times"], tokens[k], t[k]["times"])
            )
    return row


def paired_ratios(base_tokens: int, base_s: list[float], tokens: int, seconds: list[float]) -> list[float]:
    """A contestant's throughput over the baseline's, round by round (seconds by round)."""
    return [tokens * b / (base_tokens * c) for b, c in zip(base_s, seconds, strict=True)]


def own_work_ms(batch: int, prompt: int, gen: int, repeats: int = 5) -> float:
    """rollgen's per-call work (validation, settings, sharding, assembly, merge) for this shape,
    timed on this machine's CPU in this process: median milliseconds."""
    data, tokens, logprobs = make_call(batch, prompt, gen)
    t = alternate({"own": lambda: rollgen_call(data, tokens, logprobs, 1)}, repeats=repeats)["own"]
    return float(t["median_s"] * 1e3)


def own_work_share(batch: int, prompt: int, gen: int, generate_s: float, repeats: int = 5) -> dict[str, Any]:
    """``own_work_ms`` against a measured generate time."""
    own_ms = own_work_ms(batch, prompt, gen, repeats)
    return {
        "shape": f"{batch}x({prompt}+{gen})",
        "own_ms": own_ms,
        "generate_ms": generate_s * 1e3,
        "share_pct": 100 * own_ms / (generate_s * 1e3),
        "threads": torch.get_num_threads(),
    }
