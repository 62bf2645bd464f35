"""Adapter refit: the time of ``refit(adapter, target="adapter")`` by LoRA rank (every linear
layer adapted) and its bytes, beside a full-weight refit of the same engine and, for vLLM, the raw
engine's own way in the same run (``add_lora`` of the same adapter saved as a PEFT folder). The
refits are timed whole (``adapter_ms``: the median after the first), then made again with each
stage of the driver and of the rank timed apart (``driver_stages``, ``benchmarks.vllm_ext``):
the stages' synchronising wrappers add time of their own, so the stages do not sum to the total.

    python -m benchmarks.adapters --backend hf --ranks 8 64 256 --out results/...      # CPU, tiny model
    python -m benchmarks.adapters --backend vllm --shape 1.5b --ranks 8 64 256 --out $OUT  # GPU
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any, cast

import torch

import rollgen
from benchmarks.common import machine, print_table, qwen25_1p5b_dir, timed, timed_call, write_results
from benchmarks.refit import random_state
from benchmarks.vllm_ext import EXTENSION
from rollgen.refit.adapters import AdapterSpec
from rollgen.testing import tiny_config, tiny_model_dir
from rollgen.testing.reference import random_adapter

COLUMNS = [
    "backend",
    "rank",
    "adapter_mb",
    "adapter_ms",
    "mb_per_ms",
    "raw_add_lora_ms",
    "check_ms",
    "pack_ms",
    "link_ms",
    "keep_ms",
    "send_ms",
    "rank_load_adapter_ms",
    "rank_write_ms",
    "full_mb",
    "full_ms",
]


def config(backend: str, model: str, dtype: str, rank: int, dummy: bool) -> dict[str, Any]:
    cfg: dict[str, Any] = {**tiny_config(backend, model, max_new_tokens=4, dtype=dtype)}
    cfg["lora"] = {"rank": rank, "alpha": 2.0 * rank, "max_versions": 2}
    if backend == "vllm":
        cfg["vllm_cfg"] = {**cfg.get("vllm_cfg", {}), **({"load_format": "dummy"} if dummy else {})}
        cfg["vllm_kwargs"] = {**cfg.get("vllm_kwargs", {}), "worker_extension_cls": EXTENSION}
    return cfg


def save_peft_folder(
    adapter: dict[str, torch.Tensor], lora: dict[str, Any], spec: AdapterSpec, folder: Path
) -> None:
    """``adapter`` as a PEFT folder (what raw vLLM loads a LoRA from)."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: v.contiguous().cpu() for k, v in adapter.items()}, str(folder / "adapter_model.safetensors")
    )
    targets = sorted({layer.rpartition(".")[2] for layer in spec.layers})
    setup = {"peft_type": "LORA", "r": lora["rank"], "lora_alpha": lora["alpha"], "target_modules": targets}
    (folder / "adapter_config.json").write_text(json.dumps({**setup, "bias": "none"}))


def raw_add_lora_ms(model: str, dtype: str, lora: dict[str, Any], folders: list[Path], dummy: bool) -> float:
    """Median ms of raw vLLM's ``add_lora`` of each folder (a new id each time), in an engine
    with the same LoRA settings as rollgen's."""
    import vllm
    from vllm.lora.request import LoRARequest

    kwargs: dict[str, Any] = {
        "model": model,
        "dtype": dtype,
        "enable_lora": True,
        "max_lora_rank": max(8, lora["rank"]),
        "max_loras": 2,
        "max_cpu_loras": 2,
        "enforce_eager": True,
    }
    if dummy:
        kwargs["load_format"] = "dummy"
    # the memory settings rollgen's engine gets (the vLLM plugin's conformance hook)
    if torch.cuda.is_available():
        kwargs["gpu_memory_utilization"] = 0.3
    else:
        kwargs["kv_cache_memory_bytes"] = 64 << 20
    add = vllm.LLM(**kwargs).llm_engine.add_lora
    times = [timed(partial(add, LoRARequest(f"raw-{i}", i + 1, str(f)))) for i, f in enumerate(folders)]
    return 1e3 * statistics.median(times[1:] or times)


#: The driver's stages of an adapter refit timed by ``driver_stages``.
DRIVER_STAGES = ("check_s", "pack_s", "link_s", "keep_s", "send_s")


@contextmanager
def driver_stages(times: dict[str, float]) -> Iterator[None]:
    """Time, within an adapter refit in this process, each synchronised: the finite check of
    the source (``check_s``), rollgen's packing of the adapter into its bucket (``pack_s``: the
    staging buffer's pack, or a bucket of its own) and the link's delivery of it to the engines
    (``link_s``, ``apply_adapter``), and of that the copy kept for a replacement (``keep_s``,
    ``WeightBucket.copied``) and the ranks' refit channels' round trip, their load included
    (``send_s``, ``EngineChannels.call``). The functions are wrapped for the benchmark only."""
    import rollgen.refit.link as link
    import rollgen.refit.updates as updates
    from rollgen.distributed.refit_link import RayLink
    from rollgen.refit.bucket import WeightBucket
    from rollgen.refit.channel import EngineChannels
    from rollgen.refit.staging import RefitStaging

    wraps: list[tuple[Any, str, str]] = [
        (updates, "require_finite", "check_s"),
        (link, "pack_bucket", "pack_s"),
        (RefitStaging, "pack", "pack_s"),
        (RayLink, "apply_adapter", "link_s"),
        (WeightBucket, "copied", "keep_s"),
        (EngineChannels, "call", "send_s"),
    ]
    originals = [getattr(owner, attr) for owner, attr, _ in wraps]

    def wrapped(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            result, times[name] = timed_call(lambda: fn(*args, **kwargs))
            return result

        return call

    for owner, attr, name in wraps:
        setattr(owner, attr, wrapped(name, getattr(owner, attr)))
    try:
        yield
    finally:
        for (owner, attr, _), original in zip(wraps, originals):
            setattr(owner, attr, original)


def measure(args: argparse.Namespace, rank: int, model: str) -> dict[str, Any]:
    dummy = args.shape == "1.5b"
    cfg = config(args.backend, model, args.dtype, rank, dummy)
    with rollgen.create_generation(cfg) as gen:
        spec = AdapterSpec.of(cfg["lora"], gen.weight_spec)
        device = torch.device("cuda" if torch.cuda.is_available() and args.backend == "vllm" else "cpu")
        adapters = [
            {k: v.to(device) for k, v in random_adapter(spec, seed=i).items()}
            for i in range(args.repeats + 1)
        ]
        # the refits timed as a trainer makes them; then as many again, each stage timed apart
        # (the stages' synchronising wrappers add their own time, so they time no total)
        times = [timed(partial(gen.refit, adapter, target="adapter")) for adapter in adapters]
        stages = []
        for adapter in adapters:
            driver: dict[str, float] = {}
            with driver_stages(driver):
                gen.refit(adapter, target="adapter")
            if args.backend == "vllm":  # where the rank's share went (benchmarks.vllm_ext)
                driver.update(cast(Any, gen).collective_rpc("bench_last_adapter")[0][0])
            stages.append(driver)
        weights = random_state(gen.weight_spec, device)
        gen.refit(weights)
        full = [timed(lambda: gen.refit(weights)) for _ in range(args.repeats)]
    nbytes = sum(t.numel() * t.element_size() for t in adapters[0].values())
    full_bytes = sum(
        t.numel() * t.element_size() for n, t in weights.items() if n not in gen.weight_spec.tied
    )
    adapter_ms = 1e3 * statistics.median(times[1:])
    row = {
        "backend": args.backend,
        "rank": rank,
        "adapter_mb": nbytes / 1e6,
        "adapter_ms": adapter_ms,
        "mb_per_ms": nbytes / 1e6 / adapter_ms,
        "adapter_ms_all": [1e3 * t for t in times],
        "full_mb": full_bytes / 1e6,
        "full_ms": 1e3 * statistics.median(full),
        "raw_add_lora_ms": None,
    }
    later = stages[1:] or stages  # medians over the refits after the first, ms
    for key in later[0]:
        name = key[:-2] if key in DRIVER_STAGES else f"rank_{key[:-2]}"
        row[f"{name}_ms"] = 1e3 * statistics.median(s[key] for s in later)
    if args.backend == "vllm" and args.raw:
        with tempfile.TemporaryDirectory() as tmp:
            folders = [Path(tmp) / str(i) for i in range(args.repeats + 1)]
            for folder, adapter in zip(folders, adapters):
                save_peft_folder(adapter, cfg["lora"], spec, folder)
            row["raw_add_lora_ms"] = raw_add_lora_ms(model, args.dtype, cfg["lora"], folders, dummy)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--backend", choices=["hf", "hf-ray", "vllm"], default="hf")
    parser.add_argument(
        "--shape", choices=["tiny", "1.5b"], default="tiny", help="1.5b: Qwen2.5-1.5B's, dummy weights"
    )
    parser.add_argument(
        "--dtype", default="bfloat16" if torch.cuda.is_available() else "float32", help="the engine's"
    )
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 64, 256])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--raw", action=argparse.BooleanOptionalAction, default=True, help="vllm: raw add_lora too"
    )
    parser.add_argument("--out", default="out/benchmarks")
    args = parser.parse_args()
    model = qwen25_1p5b_dir() if args.shape == "1.5b" else tiny_model_dir()
    rows = [measure(args, rank, model) for rank in args.ranks]
    print_table(rows, [c for c in COLUMNS if all(c in r for r in rows)])  # rank_*: vLLM's
    write_results(
        f"adapters_{args.backend}", [{**r, "machine": machine(), "args": vars(args)} for r in rows], args.out
    )


if __name__ == "__main__":
    main()
