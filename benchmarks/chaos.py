"""Chaos: a training-style loop on a vLLM fleet of DP=2 (``engine_failures: "replace"``) whose
replicas are killed again and again (SIGKILL of a replica's engine process).

    python -m benchmarks.chaos --kills 50                 # vLLM-CPU, or CUDA where there is one
    python -m benchmarks.chaos --kills 50 --out results/benchmarks/DATE-chaos   # chaos.json there

Each round: switch the weights (a refit, alternating between two perturbed copies of the tiny
model), kill a random replica, then either ``generate`` greedily (its output must equal the
fault-free output of those weights) or stream the batch twice (``submit``; the kill between the
two), where every sample must come back once, with the fault-free tokens, stamped with the
current weight version. Then ``restore_replicas`` (start of the new engine and its catch-up
refit). Reported: rounds whose outputs differed, samples lost or repeated, the seconds to restore
full capacity (median, max), and the restarts each replica had.
"""

from __future__ import annotations

import argparse
import logging
import random
import statistics
import time
from typing import Any, cast

import torch

import rollgen
from benchmarks.common import print_table, write_results
from rollgen.distributed import RayGeneration
from rollgen.testing.config import tiny_config
from rollgen.testing.faults import kill_replica
from rollgen.testing.prompts import PROMPTS, encode
from rollgen.testing.reference import perturbed_model


def streamed_ok(
    gen: Any, batch: dict[str, torch.Tensor], clean: dict[str, torch.Tensor], victim: int
) -> bool:
    """Two streamed copies of ``batch``, ``victim`` killed between them: every sample once, with
    the fault-free tokens, under the current version."""
    first = gen.submit(batch, greedy=True)
    kill_replica(gen, victim)
    second = gen.submit(batch, greedy=True)
    results = first.wait() + second.wait()
    size = batch["input_ids"].shape[0]
    if sorted(r.index for r in results) != sorted(list(range(size)) * 2):
        return False
    lengths, starts = clean["generation_lengths"].tolist(), batch["input_lengths"].tolist()
    return all(
        r.token_ids == clean["output_ids"][r.index, starts[r.index] :][: lengths[r.index]].tolist()
        and r.versions == ((gen.weight_version, 0),)
        for r in results
    )


def chaos(kills: int, seed: int) -> dict[str, Any]:
    engine = {"data_parallel_size": 2, "engine_failures": "replace", "max_restarts": kills + 1}
    if not torch.cuda.is_available():  # the tests' CPU settings: small KV caches, quick starts
        engine.update(kv_cache_memory_bytes=64 << 20, in_process=True, cpus_per_bundle=0.1)
    cfg = tiny_config("vllm", vllm_cfg=engine)
    rng = random.Random(seed)
    with rollgen.create_generation(cfg) as created:
        gen = cast(RayGeneration, created)
        from transformers import AutoTokenizer

        batch = encode(AutoTokenizer.from_pretrained(cfg["model_name"]), PROMPTS * 2)
        weights = [perturbed_model(cfg["model_name"], 1), perturbed_model(cfg["model_name"], 2)]
        clean = []
        for w in weights:  # the fault-free outputs of each
            gen.refit(w)
            clean.append(gen.generate(batch, greedy=True))
        differing, restore_s = 0, []
        for round_ in range(kills):
            which = round_ % 2
            gen.refit(weights[which])
            victim = rng.randrange(2)
            if round_ % 3 == 2:
                differing += not streamed_ok(gen, batch, clean[which], victim)
            else:
                kill_replica(gen, victim)
                out = gen.generate(batch, greedy=True)
                differing += not torch.equal(out["output_ids"], clean[which]["output_ids"])
            start = time.perf_counter()
            status = gen.restore_replicas(timeout_s=600)
            restore_s.append(time.perf_counter() - start)
            if not all(s.state == "healthy" and s.weight_version == gen.weight_version for s in status):
                raise RuntimeError(f"round {round_}: not restored: {status}")
        return {
            "kills": kills,
            "rounds_differing": differing,
            "restore_s_median": statistics.median(restore_s),
            "restore_s_max": max(restore_s),
            "restarts": [s.restarts for s in gen.replicas],
            "device": "cuda" if torch.cuda.is_available() else "cpu",
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="out/benchmarks")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    row = chaos(args.kills, args.seed)
    print_table([row], list(row))
    print(write_results("chaos", [row], args.out))


if __name__ == "__main__":
    main()
