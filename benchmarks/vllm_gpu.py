"""GPU benchmarks of the vLLM backend against raw vLLM (Qwen2.5-1.5B shape, dummy bf16 weights,
``--batch`` prompts (256) x 128 tokens -> 256 tokens). Engines are shared between measurements
to spend less device time on start-ups.

    python -m benchmarks.vllm_gpu --part single    # one GPU: throughput eager and CUDA graphs
                                                    # (raw vLLM, raw vLLM in a Ray actor, rollgen),
                                                    # own-work share
    python -m benchmarks.vllm_gpu --part refit     # one GPU: IPC refit by bucket size (and where
                                                    # its time goes), sleep/wake against raw vLLM
    python -m benchmarks.vllm_gpu --part collective  # two GPUs: refit over NCCL from a trainer
                                                    # on the other GPU, against a bare broadcast
    python -m benchmarks.vllm_gpu --part scaling   # two GPUs: DP=2 and TP=2 against DP=1
    python -m benchmarks.vllm_gpu --part sweep     # one GPU: throughput by batch size (--sweep),
                                                    # raw vLLM and rollgen, CUDA graphs
    python -m benchmarks.vllm_gpu --part ablation  # one GPU: raw vLLM given rollgen's engine
                                                    # arguments / SamplingParams, beside rollgen
    python -m benchmarks.vllm_gpu --part profile   # one GPU: the engine core's CPU profile
                                                    # during a generate, raw vLLM and rollgen
    python -m benchmarks.vllm_gpu --part async     # DP=2 (on one GPU, or two with --gpus 2):
                                                    # streamed rollouts against fixed-batch
                                                    # generate on a long-tail workload
                                                    # (benchmarks/long_tail.py); keep-mode refit
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

import rollgen
from benchmarks import collective, cpu_profile, long_tail, refit, scaling, sleep_wake, throughput
from benchmarks.common import (
    GEN,
    PROMPT,
    QWEN25_1P5B,
    alternate,
    in_actor,
    print_table,
    qwen25_1p5b_dir,
    random_prompts,
    rollgen_generate,
    save_all,
    timed_call,
    workload_batch,
)
from benchmarks.vllm_ext import EXTENSION
from rollgen.data import BatchedDataDict
from rollgen.distributed import GenerateRequest, WorkerSpec
from rollgen.refit import device_uuid
from rollgen.sampling import SampleParams
from rollgen_vllm.worker import engine_kwargs, sampling_params

#: Ray GPU share of one engine in the single-GPU part (rollgen's and the raw actor fit on one GPU).
GPU_SHARE = 0.5
#: Ray GPU share of each engine in the ablation part (up to ten on one GPU).
ABLATION_SHARE = 0.1


def rollgen_config(model: str, eager: bool, util: float, **vllm_cfg: Any) -> dict[str, Any]:
    """rollgen's config for the workload, with the benchmarks' worker extension. Compiled
    tensor-parallel engines get vLLM's all-reduce + RMSNorm fusion off: on Hopper it uses
    FlashInfer's NVLink-multicast all-reduce, and the lent H200s run with multicast off (a
    compiled TP=2 engine hung at start there; docs/gpu-results.md)."""
    kwargs: dict[str, Any] = {"skip_tokenizer_init": True, "worker_extension_cls": EXTENSION}
    if not eager and vllm_cfg.get("tensor_parallel_size", 1) > 1:
        kwargs["compilation_config"] = {"pass_config": {"fuse_allreduce_rms": False}}
    return {
        "backend": "vllm",
        "model_name": model,
        "max_new_tokens": GEN,
        "pad_token_id": 0,
        "dtype": "bfloat16",
        "vllm_cfg": {
            "gpu_memory_utilization": util,
            "load_format": "dummy",
            "enforce_eager": eager,
            **vllm_cfg,
        },
        "vllm_kwargs": kwargs,
    }


def raw_kwargs(model: str, eager: bool, util: float) -> dict[str, Any]:
    """``vllm.LLM``'s arguments with the settings rollgen's engine gets (sleep mode on, as
    rollgen's default)."""
    return {
        "model": model,
        "dtype": "bfloat16",
        "load_format": "dummy",
        "skip_tokenizer_init": True,
        "enforce_eager": eager,
        "gpu_memory_utilization": util,
        "enable_sleep_mode": True,
        "max_model_len": QWEN25_1P5B["max_position_embeddings"],
        "disable_log_stats": True,
        "worker_extension_cls": EXTENSION,
    }


def raw_llm(model: str, eager: bool, util: float) -> Any:
    import vllm

    return vllm.LLM(**raw_kwargs(model, eager, util))


def raw_prompts(batch: dict[str, torch.Tensor]) -> list[dict[str, list[int]]]:
    """The batch as ``vllm.LLM.generate`` takes token prompts (equal lengths: no padding)."""
    return [{"prompt_token_ids": row.tolist()} for row in batch["input_ids"]]


def raw_generate(llm: Any, prompts: list[dict[str, list[int]]], params: Any = None) -> Callable[[], int]:
    """A contestant: ``llm.generate`` on ``prompts`` with ``params`` (default: one shared
    ``SamplingParams``, temperature 1, the sampled token's logprob)."""
    import vllm

    if params is None:
        params = vllm.SamplingParams(temperature=1.0, max_tokens=GEN, logprobs=0)

    def run() -> int:
        outs = llm.generate(prompts, params, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs)

    return run


def raw_in_actor(
    kwargs: dict[str, Any],
    prompts: list[dict[str, list[int]]],
    samples: list[SampleParams] | None = None,
    profiled: bool = False,
) -> tuple[Callable[[], Any], Callable[[], None]]:
    """What ``InActor`` builds: ``vllm.LLM(**kwargs)``'s contestant, generating with one shared
    ``SamplingParams`` (``samples`` None) or with rollgen's per-sample ones, each call profiled
    (``profiled_generate``) if asked; and its close."""
    import vllm

    llm = vllm.LLM(**kwargs)
    run = raw_generate(llm, prompts, None if samples is None else sampling_params(samples))
    return (partial(profiled_generate, raw_rpc(llm), run) if profiled else run), partial(close_raw, llm)


def worker_in_actor(
    spec: WorkerSpec, request: GenerateRequest
) -> tuple[Callable[[], int], Callable[[], None]]:
    """What ``InActor`` builds for the ablation's ``worker`` variant: rollgen's own ``VllmWorker``
    (TP=1), started from the spec rollgen's driver gives its worker and given the request it
    sends, in a plain Ray actor instead of rollgen's placement-group actor; its contestant
    (generated tokens) and its close."""
    from rollgen_vllm.worker import VllmWorker

    worker = VllmWorker(spec)
    return lambda: int(worker.generate(request)["generation_lengths"].sum()), worker.shutdown


def profiled_generate(rpc: Callable[..., Any], generate: Callable[[], Any]) -> dict[str, Any]:
    """One ``generate()`` under a CPU profile of the engine-core step loop of TP rank 0 of the
    first engine, asked through ``rpc`` (a ``collective_rpc``; the engine needs the benchmarks'
    worker extension)."""
    rpc("bench_profile", True)
    _, seconds = timed_call(generate)
    return {"wall_s": seconds, **first_rank(rpc("bench_profile", False))}


def first_rank(answers: list[Any]) -> Any:
    """TP rank 0's answer of the first engine: ``vllm.LLM.collective_rpc`` answers per rank,
    ``VllmGeneration.collective_rpc`` per engine, then per rank."""
    first = answers[0]
    return first[0] if isinstance(first, list) else first


def raw_rpc(llm: Any) -> Callable[..., Any]:
    """``llm.collective_rpc`` called as ``VllmGeneration.collective_rpc`` is."""
    return lambda method, *args: llm.collective_rpc(method, args=args)


def close_raw(llm: Any) -> None:
    llm.llm_engine.engine_core.shutdown()
    gc.collect()
    torch.cuda.empty_cache()


def engine_device(gen: Any) -> torch.device:
    """The local CUDA device the (TP=1) engine runs on, found by its GPU's UUID."""
    uuid = gen.updates.facts.devices[0]
    for i in range(torch.cuda.device_count()):
        if device_uuid(i) == uuid:
            return torch.device("cuda", i)
    raise RuntimeError(f"engine GPU {uuid} is not visible here; run with both on one GPU")


def single(args: argparse.Namespace, model: str) -> dict[str, list]:
    batch = workload_batch(args.batch)
    results: dict[str, list] = {"throughput": [], "own_work": []}
    prompts = raw_prompts(batch)
    for mode in args.modes:
        eager = mode == "eager"
        gen = rollgen.create_generation(rollgen_config(model, eager, args.util, gpus_per_bundle=GPU_SHARE))
        llm = raw_llm(model, eager, args.util)
        in_actor_run, close_actor = in_actor(
            partial(raw_in_actor, raw_kwargs(model, eager, args.util), prompts), GPU_SHARE
        )
        contestants = {
            "raw": raw_generate(llm, prompts),
            "raw_in_actor": in_actor_run,
            "rollgen": rollgen_generate(gen, batch),
        }
        row = throughput.measure(mode, contestants, args.repeats)
        results["throughput"].append(row)
        print_table([row], ["mode", "raw_tok_s", "raw_in_actor_ratio", "rollgen_tok_s", "rollgen_ratio"])
        share = throughput.own_work_share(args.batch, PROMPT, GEN, row["rollgen_s"])
        results["own_work"].append({"mode": mode, **share})
        close_actor()
        gen.shutdown()
        close_raw(llm)
        save(args, results)  # after each mode: a run cut off by a time limit keeps what it measured
    return results


def refit_part(args: argparse.Namespace, model: str) -> dict[str, list]:
    """rollgen's engine (CUDA graphs; ``--eager``: eager, as refits do not use them) for the
    refit through the staging buffers (two states in turn) and in place (one state again), and
    sleep/wake against raw vLLM's beside it (``--no-sleep-wake``: no raw engine). ``--loaders``
    runs vLLM's weight loaders on every refit instead of replaying load plans; ``--in-process``
    runs rollgen's engine core in its actor's process."""
    config = rollgen_config(
        model,
        args.eager,
        args.util,
        gpus_per_bundle=GPU_SHARE,
        replay_refit=not args.loaders,
        in_process=args.in_process,
        refit_in_place=True,
    )
    gen: Any = rollgen.create_generation(config)
    llm = None if args.no_sleep_wake else raw_llm(model, False, args.util)
    device = engine_device(gen)
    states = [refit.random_state(gen.weight_spec, device) for _ in range(2)]
    results: dict[str, list] = {}

    def step(name: str, rows: list[dict[str, Any]], columns: list[str] | None = None) -> None:
        print_table(rows, columns or list(rows[0]))
        results[name] = rows
        save(args, results)  # after each step: a run cut off keeps what it measured

    staged = refit.measure(gen, states, args.bucket_mib, args.repeats, "staged")
    in_place = refit.measure(gen, states[:1], [0], args.repeats, "in place")
    step("by_bucket", staged + in_place, refit.COLUMNS)
    staged_steps = refit.breakdown(gen, states, args.repeats, "staged")
    step("breakdown", [staged_steps, refit.breakdown(gen, states[:1], args.repeats, "in place")])
    step("driver_profile", refit.driver_profile(gen, states[:1], args.repeats))
    step("finite_check", [refit.finite_check(states[0], args.repeats)])
    step("after_generate", [refit.after_generate(gen, states[0], workload_batch(1), args.repeats)])
    step("profile", [refit.profile(gen, states[0], mib) for mib in args.bucket_mib])
    step("ephemeral", [refit.ephemeral(gen, states[0], args.repeats)])
    del states
    gen.release_refit_buffers()
    torch.cuda.empty_cache()
    if llm is not None:
        sleeps = [
            sleep_wake.measure_rollgen(gen, device.index, args.repeats),
            sleep_wake.measure("raw", partial(llm.sleep, level=1), [llm.wake_up], device.index, args.repeats),
        ]
        step("sleep_wake", sleeps, sleep_wake.COLUMNS)
        close_raw(llm)
    gen.shutdown()
    return results


def collective_part(args: argparse.Namespace, model: str) -> dict[str, list]:
    """rollgen's engine (CUDA graphs, TP=1) on one GPU, the trainer (this process) on another:
    refit over a weight-sync group (NCCL), against a bare NCCL broadcast of the same bytes
    between the same GPUs (one piece, and 256 MiB pieces)."""
    gen: Any = rollgen.create_generation(rollgen_config(model, False, args.util))
    engine = engine_device(gen)
    mine = next(i for i in range(torch.cuda.device_count()) if i != engine.index)
    torch.cuda.set_device(mine)
    gen.init_weight_sync(gen.weight_sync_spec("127.0.0.1"), local_sender=True)
    state = refit.random_state(gen.weight_spec, torch.device("cuda", mine))
    refits = refit.measure(gen, [state], args.bucket_mib, args.repeats, "collective")
    nbytes = int(refits[0]["gb"] * 1e9)
    del state
    torch.cuda.empty_cache()
    floors = {
        "whole": collective.broadcast_floor(nbytes, mine, engine.index, args.repeats),
        "256MiB": collective.broadcast_floor(nbytes, mine, engine.index, args.repeats, 256 << 20),
    }
    for row in refits:
        row["nccl_floor_ms"] = floors["whole"] * 1e3
        row["vs_nccl_floor"] = row["refit_ms"] / row["nccl_floor_ms"]
    floor_rows = [{"pieces": k, "gb": nbytes / 1e9, "broadcast_ms": v * 1e3} for k, v in floors.items()]
    print_table(refits, [*refit.COLUMNS, "nccl_floor_ms", "vs_nccl_floor"])
    print_table(floor_rows, list(floor_rows[0]))
    gen.shutdown()
    return {"by_bucket": refits, "nccl_floor": floor_rows}


def sweep(args: argparse.Namespace, model: str) -> dict[str, list]:
    """Throughput by batch size with CUDA graphs: raw vLLM and rollgen on one GPU, alternating
    at each size (one pair of engines for the whole sweep)."""
    gen = rollgen.create_generation(rollgen_config(model, False, args.util, gpus_per_bundle=GPU_SHARE))
    llm = raw_llm(model, False, args.util)
    results: dict[str, list] = {"throughput": []}
    for n in args.sweep:
        batch = workload_batch(n)
        prompts = raw_prompts(batch)
        contestants = {"raw": raw_generate(llm, prompts), "rollgen": rollgen_generate(gen, batch)}
        results["throughput"].append({"batch": n, **throughput.measure("graphs", contestants, args.repeats)})
        print_table(results["throughput"][-1:], ["batch", "raw_tok_s", "rollgen_tok_s", "rollgen_ratio"])
        save(args, results)
    gen.shutdown()
    close_raw(llm)
    return results


#: The ablation's variants without ``--each-arg``: raw vLLM given rollgen's engine arguments,
#: its per-sample SamplingParams, or both; ``placed``: both, in an actor placed as rollgen places
#: its worker; ``worker``: rollgen's own worker in a plain actor.
COMBINED = ("engine_args", "sample_params", "both", "placed", "worker")


def ablation_variants(
    raw: dict[str, Any],
    ours: dict[str, Any],
    defaults: dict[str, Any],
    each_arg: bool,
    combined: tuple[str, ...] = COMBINED,
) -> tuple[dict[str, tuple[dict[str, Any], bool, bool]], dict[str, Any]]:
    """The ablation's raw-engine contestants (name -> engine arguments, whether it uses rollgen's
    per-sample SamplingParams, whether its actor is placed as rollgen's) and the engine arguments
    where rollgen's (``ours``) differ from the raw engine's (``raw``, else vLLM's ``defaults``)."""
    differing = {k: v for k, v in ours.items() if raw.get(k, defaults.get(k)) != v}
    variants = {"raw_in_actor": (raw, False, False)}
    if each_arg:
        variants.update({f"arg_{k}": ({**raw, k: v}, False, False) for k, v in differing.items()})
    else:
        options = {
            "engine_args": (ours, False, False),
            "sample_params": (raw, True, False),
            "both": (ours, True, False),
            "placed": (ours, True, True),
        }
        variants.update({name: options[name] for name in combined if name in options})
    return variants, differing


def ablation(args: argparse.Namespace, model: str) -> dict[str, list]:
    """Where a throughput gap between rollgen and raw vLLM comes from: raw vLLM in plain Ray
    actors on one GPU given rollgen's engine arguments and/or its per-sample SamplingParams, both
    in an actor placed as rollgen's, or rollgen's own worker in a plain actor (``--variants``;
    ``--each-arg``: each engine argument that differs, one at a time), beside rollgen itself;
    alternating, each against raw vLLM in an actor. With ``--util 0.1``: up to ten engines fit;
    they start one after another (about a minute each on the H200 host)."""
    import dataclasses

    import vllm

    batch = workload_batch(args.batch)
    prompts = raw_prompts(batch)
    defaults = {f.name: f.default for f in dataclasses.fields(vllm.EngineArgs)}
    results: dict[str, list] = {"ablation": []}
    for mode in args.modes:
        eager = mode == "eager"
        gen: Any = rollgen.create_generation(
            rollgen_config(model, eager, args.util, gpus_per_bundle=ABLATION_SHARE)
        )
        raw, ours = raw_kwargs(model, eager, args.util), engine_kwargs(gen.worker_specs[0], None)
        variants, differing = ablation_variants(raw, ours, defaults, args.each_arg, tuple(args.variants))
        samples = gen.sample_params(batch, greedy=False)
        started = {
            name: in_actor(
                partial(raw_in_actor, kwargs, prompts, samples if per_sample else None),
                ABLATION_SHARE,
                placed,
            )
            for name, (kwargs, per_sample, placed) in variants.items()
        }
        if "worker" in args.variants and not args.each_arg:
            request = GenerateRequest.shards(BatchedDataDict(batch), samples, 1)[0]
            started["worker"] = in_actor(
                partial(worker_in_actor, gen.worker_specs[0], request), ABLATION_SHARE
            )
        contestants = {name: run for name, (run, _) in started.items()}
        contestants["rollgen"] = rollgen_generate(gen, batch)
        row = {**throughput.measure(mode, contestants, args.repeats), "differing_args": differing}
        results["ablation"].append(row)
        print_table([row], ["mode"] + [f"{k}_ratio" for k in list(contestants)[1:]])
        for _, close in started.values():
            close()
        gen.shutdown()
        save(args, results)
    return results


def profile_part(args: argparse.Namespace, model: str) -> dict[str, list]:
    """Where the engine core's CPU time goes during one generate: raw vLLM with rollgen's
    engine arguments and per-sample SamplingParams in a plain Ray actor, and rollgen, both on
    one GPU; each generate under cProfile in its engine core's step loop (asked through
    ``collective_rpc``), alternating, ``--repeats`` each after a warm-up. Reports wall and
    profiled seconds and the functions whose own time differs most (cProfile slows Python-heavy
    steps: compare the two, not against other parts)."""
    batch = workload_batch(args.batch)
    results: dict[str, list] = {"profile": []}
    for mode in args.modes:
        gen: Any = rollgen.create_generation(
            rollgen_config(model, mode == "eager", args.util, gpus_per_bundle=ABLATION_SHARE)
        )
        samples = gen.sample_params(batch, greedy=False)
        kwargs = engine_kwargs(gen.worker_specs[0], None)
        raw_run, close = in_actor(
            partial(raw_in_actor, kwargs, raw_prompts(batch), samples, True), ABLATION_SHARE
        )
        contestants: dict[str, Callable[[], Any]] = {
            "raw": raw_run,
            "rollgen": partial(profiled_generate, gen.collective_rpc, rollgen_generate(gen, batch)),
        }
        rounds = alternate(contestants, repeats=args.repeats)
        summary = {name: cpu_profile.summarize(r["results"]) for name, r in rounds.items()}
        diffs = cpu_profile.differences(summary["raw"], summary["rollgen"])
        row = {
            "mode": mode,
            **{f"{name}_{k}": summary[name][k] for name in summary for k in ("wall_s", "profiled_s")},
            "differences": diffs,
            "summary": summary,
        }
        results["profile"].append(row)
        print_table([row], ["mode", "raw_wall_s", "rollgen_wall_s", "raw_profiled_s", "rollgen_profiled_s"])
        print_table(diffs, ["function", "base_ms", "other_ms", "diff_ms"])
        close()
        gen.shutdown()
        save(args, results)
    return results


#: The scaling part's layouts, in the order they run (the first one run is the baseline).
LAYOUTS: dict[str, dict[str, int]] = {
    "dp1": {},
    "dp2": {"data_parallel_size": 2},
    "tp2": {"tensor_parallel_size": 2},
}


def scaling_part(args: argparse.Namespace, model: str) -> dict[str, list]:
    """The ``--layouts`` one after another on two GPUs, in each of ``--modes``; each against the
    mode's first layout."""
    batch = workload_batch(args.batch)
    results: dict[str, list] = {"scaling": []}
    for mode in args.modes:
        done, rows = results["scaling"], []
        for name in [n for n in LAYOUTS if n in args.layouts]:
            config = rollgen_config(model, mode == "eager", args.util, **LAYOUTS[name])
            with rollgen.create_generation(config) as gen:
                rows.append(
                    {"mode": mode, **scaling.measure(name, rollgen_generate(gen, batch), args.repeats)}
                )
            print_table(rows[-1:], ["mode", "layout", "tok_s", "tok_s_min", "tok_s_max"])
            results = {"scaling": done + scaling.relative_to_first(rows)}
            save(args, results)  # after each layout: a run cut off by a time limit keeps it
    return results


def async_part(args: argparse.Namespace, model: str) -> dict[str, list]:
    """rollgen with DP=2 (CUDA graphs): ``--samples`` prompts with log-normal budgets, fixed
    batches of ``--batch`` through ``generate`` against chunks of ``--chunk`` streamed with
    ``--batch`` in flight; then a keep-mode refit while a window streams."""
    share = 1.0 if args.gpus == 2 else GPU_SHARE
    config = rollgen_config(model, False, args.util, gpus_per_bundle=share, data_parallel_size=2)
    config["vllm_kwargs"]["max_num_seqs"] = args.batch // 2  # both methods: the same concurrency
    gen: Any = rollgen.create_generation(config)
    budget = long_tail.budgets(args.samples, args.median, args.sigma, args.cap)
    batch = long_tail.long_tail_batch(random_prompts(args.samples, PROMPT, QWEN25_1P5B["vocab_size"]), budget)
    contestants = {
        "generate": long_tail.synchronous(gen, batch, args.batch),
        "streaming": long_tail.streaming(gen, batch, args.chunk, args.batch),
    }
    rows = long_tail.measure(contestants, args.samples, args.repeats, long_tail.GpuBusy())
    for row in rows:
        row.update(
            budget_median=float(budget.median()),
            budget_max=int(budget.max()),
            budget_mean=float(budget.float().mean()),
        )
    print_table(rows, [*long_tail.COLUMNS, "speedup"])
    results: dict[str, list] = {"long_tail": rows}
    save(args, results)
    state = refit.random_state(gen.weight_spec, engine_device(gen))
    window = {k: v[: args.batch] for k, v in batch.items()}
    pause = [long_tail.keep_refit_pause(gen, state, window, args.batch // 8, args.repeats)]
    print_table(pause, ["samples", "refit_idle_ms", "refit_keep_ms", "pause_ms", "samples_cut"])
    results["keep_refit"] = pause
    gen.shutdown()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--part", choices=list(PARTS), required=True)
    parser.add_argument("--modes", nargs="+", default=["eager", "graphs"], choices=["eager", "graphs"])
    parser.add_argument("--batch", type=int, default=256, help="prompts per generate call")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--util", type=float, default=0.25)
    parser.add_argument("--sweep", type=int, nargs="+", default=[32, 64, 128, 256, 512, 1024])
    refit.add_bucket_argument(parser)
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--loaders", action="store_true", help="refit part: no load-plan replay")
    parser.add_argument(
        "--in-process", action="store_true", help="refit part: rollgen's engine core in its actor's process"
    )
    parser.add_argument("--eager", action="store_true", help="refit part: an eager engine")
    parser.add_argument(
        "--no-sleep-wake", action="store_true", help="refit part: no raw engine, no sleep/wake"
    )
    parser.add_argument(
        "--each-arg", action="store_true", help="ablation part: one engine argument at a time"
    )
    parser.add_argument(
        "--variants",
        nargs="*",
        default=list(COMBINED),
        choices=COMBINED,
        help="ablation part, without --each-arg (none: raw vLLM in an actor against rollgen only)",
    )
    parser.add_argument("--samples", type=int, default=1024, help="async part: prompts in all")
    parser.add_argument("--chunk", type=int, default=128, help="async part: prompts per submit")
    parser.add_argument("--median", type=int, default=192, help="async part: median output budget")
    parser.add_argument("--sigma", type=float, default=1.0, help="async part: log-normal spread")
    parser.add_argument("--cap", type=int, default=2048, help="async part: longest output budget")
    parser.add_argument("--gpus", type=int, default=1, choices=[1, 2], help="async part: GPUs for DP=2")
    parser.add_argument("--out", default="out/benchmarks")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")  # the driver also runs Ray
    logging.basicConfig(level=logging.INFO)
    save(args, PARTS[args.part](args, qwen25_1p5b_dir()))


def save(args: argparse.Namespace, results: dict[str, list]) -> None:
    save_all(f"vllm_gpu_{args.part}", results, args.out)


PARTS: dict[str, Callable[[argparse.Namespace, str], dict[str, list]]] = {
    "single": single,
    "refit": refit_part,
    "collective": collective_part,
    "sweep": sweep,
    "scaling": scaling_part,
    "ablation": ablation,
    "profile": profile_part,
    "async": async_part,
}

if __name__ == "__main__":
    main()
