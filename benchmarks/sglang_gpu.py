"""GPU benchmarks of the sglang backend against SGLang's raw offline ``sglang.Engine`` on one GPU,
with the workload of ``benchmarks.vllm_gpu`` (Qwen2.5-1.5B shape, dummy bf16 weights, ``--batch``
prompts x 128 tokens -> 256, CUDA graphs): throughput (raw, raw inside a plain Ray actor,
rollgen; alternating, paired ratios) and rollgen's own-work share, refit by CUDA IPC by bucket
size against a device-to-device copy, and sleep/wake.

    CUDA_VISIBLE_DEVICES=0 python -m benchmarks.sglang_gpu --out out/benchmarks

The raw engine starts first: SGLang checks ``mem_fraction_static`` against the memory free when
it starts, so rollgen's engine, started second, asks for the raw one's share plus its own, and
the raw engine in a Ray actor, third, for three shares.
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

import rollgen
from benchmarks import refit, sleep_wake, throughput
from benchmarks.common import (
    GEN,
    PROMPT,
    QWEN25_1P5B,
    in_actor,
    print_table,
    qwen25_1p5b_dir,
    rollgen_generate,
    save_all,
    workload_batch,
)


def engine_settings(model: str, mem_fraction: float, sleep_on_idle: bool) -> dict[str, Any]:
    """What both engines get (rollgen's worker passes the same keys from its config)."""
    return {
        "sleep_on_idle": sleep_on_idle,
        "model_path": model,
        "dtype": "bfloat16",
        "load_format": "dummy",
        "skip_tokenizer_init": True,  # the model folder holds only config.json
        "mem_fraction_static": mem_fraction,
        "enable_memory_saver": True,
        "enable_weights_cpu_backup": True,  # rollgen's default: weights survive a sleep
        "context_length": QWEN25_1P5B["max_position_embeddings"],
        "log_level": "error",
    }


def rollgen_config(model: str, mem_fraction: float, sleep_on_idle: bool) -> dict[str, Any]:
    return {
        "backend": "sglang",
        "model_name": model,
        "max_new_tokens": GEN,
        "pad_token_id": 0,
        "dtype": "bfloat16",
        "sglang_cfg": {
            "mem_fraction_static": mem_fraction,
            "load_format": "dummy",
            "gpus_per_bundle": 0.5,
            "sleep_on_idle": sleep_on_idle,
        },
        "sglang_kwargs": {"skip_tokenizer_init": True},
    }


def raw_generate(engine: Any, prompts: list[list[int]]) -> Callable[[], int]:
    params = {"temperature": 1.0, "max_new_tokens": GEN}

    def run() -> int:
        outs = engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
        return sum(len(o["output_ids"]) for o in outs)

    return run


def raw_in_actor(settings: dict[str, Any], prompts: list[list[int]]) -> Any:
    """What ``InActor`` builds: raw SGLang's contestant and its close function."""
    os.environ["SGLANG_RETURN_ORIGINAL_LOGPROB"] = "1"
    import sglang

    engine = sglang.Engine(**settings)
    return raw_generate(engine, prompts), engine.shutdown


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch", type=int, default=256, help="prompts per generate call")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--mem-fraction", type=float, default=0.2, help="each engine's share of the GPU")
    refit.add_bucket_argument(parser)
    parser.add_argument(
        "--sleep-on-idle",
        action="store_true",
        help="every engine's scheduler waits for work instead of polling (SGLang's sleep_on_idle; "
        "rollgen's default, SGLang's is to poll): without it all three engines poll",
    )
    parser.add_argument(
        "--parts",
        nargs="+",
        choices=["throughput", "refit", "sleep_wake"],
        default=["throughput", "refit", "sleep_wake"],
    )
    parser.add_argument("--out", default="out/benchmarks")
    args = parser.parse_args()
    if torch.cuda.device_count() != 1:
        parser.error("run on one visible GPU (CUDA_VISIBLE_DEVICES=N): both engines share it")
    logging.basicConfig(level=logging.INFO)
    # the raw engine returns the logprobs rollgen's worker asks for (raw, before temperature)
    os.environ["SGLANG_RETURN_ORIGINAL_LOGPROB"] = "1"
    if "throughput" in args.parts:
        # timed again once the engines run: polling schedulers made it 13x slower (BENCHMARKS.md)
        own_ms_before_engines = throughput.own_work_ms(args.batch, PROMPT, GEN)
    import sglang

    model, batch = qwen25_1p5b_dir(), workload_batch(args.batch)
    idle = args.sleep_on_idle
    engine = sglang.Engine(**engine_settings(model, args.mem_fraction, idle))
    gen: Any = rollgen.create_generation(rollgen_config(model, 2 * args.mem_fraction, idle))
    results: dict[str, list[dict[str, Any]]] = {}

    def save() -> None:
        save_all("sglang_gpu", results, args.out)

    if "throughput" in args.parts:
        prompts = batch["input_ids"].tolist()
        in_actor_run, close_actor = in_actor(
            partial(raw_in_actor, engine_settings(model, 3 * args.mem_fraction, idle), prompts), gpus=0.25
        )
        contestants = {
            "raw": raw_generate(engine, prompts),
            "raw_in_actor": in_actor_run,
            "rollgen": rollgen_generate(gen, batch),
        }
        row = {**throughput.measure("graphs", contestants, args.repeats), "sleep_on_idle": idle}
        close_actor()
        results["throughput"] = [row]
        results["own_work"] = [
            {
                "mode": "graphs",
                "sleep_on_idle": idle,
                **throughput.own_work_share(args.batch, PROMPT, GEN, row["rollgen_s"]),
                "own_ms_before_engines": own_ms_before_engines,
            }
        ]
        print_table([row], ["mode", "raw_tok_s", "raw_in_actor_ratio", "rollgen_tok_s", "rollgen_ratio"])
        print_table(results["own_work"], ["sleep_on_idle", "own_ms_before_engines", "own_ms", "share_pct"])
        save()

    device = torch.device("cuda", 0)
    if "refit" in args.parts:
        state = refit.random_state(gen.weight_spec, device)
        results["refit"] = refit.measure(gen, [state], args.bucket_mib, args.repeats, "staged")
        del state
        torch.cuda.empty_cache()
        print_table(results["refit"], refit.COLUMNS)
        save()

    if "sleep_wake" in args.parts:
        results["sleep_wake"] = [
            sleep_wake.measure_rollgen(gen, device.index, args.repeats),
            sleep_wake.measure(
                "raw",
                engine.release_memory_occupation,
                [engine.resume_memory_occupation],
                device.index,
                args.repeats,
            ),
        ]
        print_table(results["sleep_wake"], sleep_wake.COLUMNS)
        save()
    gen.shutdown()
    engine.shutdown()


if __name__ == "__main__":
    main()
