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


def alternate(fns: dict[str, Callable[[], Any]], repeats: int, warmup: int = 1) -> dict[str, dict[str, Any]]:
    """Time each function ``repeats`` times, interleaved, after ``warmup`` rounds; each round
    starts one later than the last (A B C, B C A, C A B, ...) so that no function always runs in
    the same place. Median, min and max seconds per function, and every run's seconds and return
    value by round (``times``, ``results``)."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    names = list(fns)
    times: dict[str, list[float]] = {k: [] for k in fns}
    results: dict[str, list[Any]] = {k: [] for k in fns}
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            t = time.perf_counter()
            results[name].append(fns[name]())
            times[name].append(time.perf_counter() - t)
    return {
        k: {
            "median_s": statistics.median(v),
            "min_s": min(v),
            "max_s": max(v),
            "runs": len(v),
            "times": v,
            "results": results[k],
        }
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


# ---- GPU engine benchmarks ------------------------------------------------------------------------

#: Qwen2.5-1.5B's dimensions (the issue's workload); weights are vLLM's/SGLang's "dummy" ones.
QWEN25_1P5B: dict[str, Any] = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 1536,
    "intermediate_size": 8960,
    "num_hidden_layers": 28,
    "num_attention_heads": 12,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "bos_token_id": 151643,
    "eos_token_id": 151643,
}


def qwen25_1p5b_dir(root: str = "/tmp/rollgen-bench/qwen2.5-1.5b-shape", tokenizer: bool = False) -> str:
    """A model folder with Qwen2.5-1.5B's config.json (no weights) and, if asked (in a folder of
    its own), a tokenizer for servers that detokenize (``word_level_tokenizer``)."""
    path = Path(root + "-tok" if tokenizer else root)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(QWEN25_1P5B, indent=2))
    if tokenizer and not (path / "tokenizer.json").is_file():
        word_level_tokenizer(QWEN25_1P5B["vocab_size"], QWEN25_1P5B["eos_token_id"]).save_pretrained(path)
    return str(path)


#: Qwen2.5-7B's dimensions (weights dummy, as for the 1.5B shape); its context kept at the 1.5B
#: shape's 2048 positions (the workloads use 256).
QWEN25_7B: dict[str, Any] = {
    **QWEN25_1P5B,
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "vocab_size": 152064,
    "tie_word_embeddings": False,
}


def qwen25_7b_dir(root: str = "/tmp/rollgen-bench/qwen2.5-7b-shape") -> str:
    """A model folder with Qwen2.5-7B's config.json (no weights)."""
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(QWEN25_7B, indent=2))
    return str(path)


def word_level_tokenizer(vocab_size: int, eos_id: int) -> Any:
    """A fast tokenizer of ``vocab_size`` words (`` t0``, `` t1``, ...; ``eos_id`` is
    ``<|endoftext|>``), so that every id a model of that vocabulary samples decodes to text. The
    words are written in the byte-level alphabet (``Ġ`` is a space): transformers 5 loads a
    folder whose config says ``qwen2`` with Qwen2's byte-level tokenizer class whatever the
    tokenizer files say."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    eos = "<|endoftext|>"
    vocab = {f"\u0120t{i}": i for i in range(vocab_size) if i != eos_id} | {eos: eos_id}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="\u0120t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    pad = "\u0120t0"
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, pad_token=pad, model_max_length=2048)


#: The GPU workload: prompts of PROMPT random token ids, GEN new tokens each (temperature 1).
PROMPT, GEN = 128, 256


def random_prompts(n: int, length: int, vocab: int, seed: int = 0) -> torch.Tensor:
    """``n`` prompts of ``length`` random token ids (no padding needed: equal lengths)."""
    return torch.randint(10, vocab - 10, (n, length), generator=torch.Generator().manual_seed(seed))


def workload_batch(n: int) -> dict[str, torch.Tensor]:
    """rollgen's input for ``n`` prompts of the GPU workload."""
    return {
        "input_ids": random_prompts(n, PROMPT, QWEN25_1P5B["vocab_size"]),
        "input_lengths": torch.full((n,), PROMPT),
    }


def rollgen_generate(gen: Any, batch: dict[str, torch.Tensor]) -> Callable[[], int]:
    """A contestant: one rollgen generate call on ``batch``, returning the tokens it generated."""

    def run() -> int:
        out = gen.generate(batch)
        return int((out["unpadded_sequence_lengths"] - batch["input_lengths"]).sum())

    return run


class InActor:
    """A raw engine inside a plain Ray actor: ``make()`` (run in the actor) builds it and returns
    its generate contestant and its close function. It tells what running in a Ray worker
    process costs apart from rollgen's own code."""

    def __init__(self, make: Callable[[], tuple[Callable[[], Any], Callable[[], None]]]) -> None:
        self.run, self.close = make()

    def ready(self) -> None:
        """Returns once ``make()`` has run (the engine is up)."""

    def generate(self) -> Any:
        return self.run()

    def shutdown(self) -> None:
        self.close()


class PlacedInActor(InActor):
    """``InActor`` built by rollgen's ``RayWorkerGroup``, which also passes the tied group and
    index (unused)."""

    def __init__(self, make: Callable[[], tuple[Callable[[], Any], Callable[[], None]]], *_: Any) -> None:
        super().__init__(make)


def in_actor(
    make: Callable[[], tuple[Callable[[], Any], Callable[[], None]]], gpus: float, placed: bool = False
) -> tuple[Callable[[], Any], Callable[[], None]]:
    """Start ``InActor(make)`` with 1 CPU and ``gpus`` of a GPU and wait until its engine is up
    (engines sharing a GPU start one at a time); its contestant and a function that shuts it
    down. ``placed``: placed as rollgen places a TP=1 leader instead (its own placement group of
    one bundle of ``gpus``, the leader's share of it, a runtime env), by rollgen's own code. The
    contestant's first call is the warm-up, as for every contestant of ``measure``."""
    import ray

    from rollgen.distributed.generation import leader_resources
    from rollgen.distributed.virtual_cluster import RayVirtualCluster
    from rollgen.distributed.worker_groups import RayWorkerBuilder, RayWorkerGroup

    cluster = None
    if placed:
        cluster = RayVirtualCluster([1], gpus > 0, 1.0, name="bench-placed", gpus_per_bundle=gpus or 1.0)
        builder = RayWorkerBuilder(f"{__name__}:PlacedInActor", lambda group, i: (make, group, i))
        resources = leader_resources(cluster, 1, gpus > 0)
        actor = RayWorkerGroup(cluster, builder, 1, leader_resources=resources).workers[0]
    else:
        actor = ray.remote(num_cpus=1, num_gpus=gpus)(InActor).remote(make)
    ray.get(actor.ready.remote())

    def close() -> None:
        ray.get(actor.shutdown.remote())
        ray.kill(actor)
        if cluster is not None:
            cluster.shutdown()

    return lambda: ray.get(actor.generate.remote()), close


def save_all(prefix: str, results: dict[str, list[dict[str, Any]]], out_dir: str) -> None:
    """Writes each non-empty measurement as ``<prefix>_<name>.json`` (callable after each step,
    so that a run cut off by a time limit keeps what it measured)."""
    for name, rows in results.items():
        if rows:
            print(f"results: {write_results(f'{prefix}_{name}', rows, out_dir)}")


def gpu_used_gib(device: int = 0) -> float:
    """Device-wide memory in use (every process), GiB."""
    free, total = torch.cuda.mem_get_info(device)
    return (total - free) / 2**30


def timed_call(fn: Callable[[], Any]) -> tuple[Any, float]:
    """What one call returns and the seconds it takes, synchronising CUDA (where there is one)
    before and after."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    t = time.perf_counter()
    result = fn()
    sync()
    return result, time.perf_counter() - t


def timed(fn: Callable[[], Any]) -> float:
    """Seconds one call takes (CUDA synchronised)."""
    return timed_call(fn)[1]
