"""Generation throughput: rollgen against the raw engine on the same GPU and workload,
alternating, plus rollgen's own per-call work as a share of its generate time."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from benchmarks.common import alternate
from benchmarks.overhead import make_call, rollgen_call


def measure(
    name: str,
    raw_generate: Callable[[], int],
    rollgen_generate: Callable[[], int],
    repeats: int,
) -> dict[str, Any]:
    """Both callables run the same batch and return the output tokens they produced (the first
    call of each, which counts them, is the warm-up)."""
    tokens = {"raw": raw_generate(), "rollgen": rollgen_generate()}
    t = alternate({"raw": raw_generate, "rollgen": rollgen_generate}, repeats=repeats, warmup=0)
    row: dict[str, Any] = {"mode": name, "tokens_raw": tokens["raw"], "tokens_rollgen": tokens["rollgen"]}
    for k in ("raw", "rollgen"):
        row[f"{k}_tok_s"] = tokens[k] / t[k]["median_s"]
        row[f"{k}_tok_s_min"] = tokens[k] / t[k]["max_s"]
        row[f"{k}_tok_s_max"] = tokens[k] / t[k]["min_s"]
        row[f"{k}_s"] = t[k]["median_s"]
    row["ratio"] = row["rollgen_tok_s"] / row["raw_tok_s"]
    return row


def own_work_share(batch: int, prompt: int, gen: int, generate_s: float, repeats: int = 5) -> dict[str, Any]:
    """rollgen's per-call work (validation, settings, sharding, assembly, merge) for this shape,
    timed on this machine's CPU, against a measured generate time."""
    data, tokens, logprobs = make_call(batch, prompt, gen)
    t = alternate({"own": lambda: rollgen_call(data, tokens, logprobs, 1)}, repeats=repeats)["own"]
    return {
        "shape": f"{batch}x({prompt}+{gen})",
        "own_ms": t["median_s"] * 1e3,
        "generate_ms": generate_s * 1e3,
        "share_pct": 100 * t["median_s"] / generate_s,
        "threads": torch.get_num_threads(),
    }
