"""Failures of real vLLM engines (vllm-cpu in CI) and what rollgen makes of them: seeded long
prompts (chunked prefill on CPU), a replica that dies under a streamed rollout, an ``abort``
update with samples waiting on the driver; a wedged engine (a stand-in, ``vllm_faults``) that
no call waits on for ever."""

import importlib.util

import pytest
import ray
import torch

import rollgen
from rollgen import WorkerError
from rollgen.data import right_pad
from rollgen.testing import load_reference_model, tiny_config
from rollgen.testing.prompts import PROMPTS, encode
from tests.waiting import SAFETY_S, wait_until

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm not installed")

#: Per engine: with 200-token prompts, more prompt tokens than vLLM-CPU's step budget (4096), so
#: a step would cut prefills into chunks; with short ones, fewer slots than streamed samples.
MAX_NUM_SEQS = 32
ENGINE = {"kv_cache_memory_bytes": 64 << 20, "in_process": True, "cpus_per_bundle": 0.1}


@pytest.fixture(scope="module")
def seeded(model_dir: str):
    """DP=2 on the tiny test config (``seed: 0``: every sample seeded)."""
    cfg = tiny_config(
        "vllm",
        model_dir,
        vllm_cfg={**ENGINE, "data_parallel_size": 2},
        vllm_kwargs={"max_num_seqs": MAX_NUM_SEQS},
    )
    with rollgen.create_generation(cfg) as gen:
        yield gen


@pytest.fixture(scope="module")
def long_prompts() -> dict:
    """64 prompts of 200 tokens."""
    rng = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 500, (200,), generator=rng).tolist() for _ in range(64)]
    ids, lengths = right_pad(prompts, 1, torch.long)
    return {"input_ids": ids, "input_lengths": lengths}


@pytest.fixture(scope="module")
def short_prompts(model_dir: str) -> dict:
    """More short prompts than the engines have slots (``MAX_NUM_SEQS`` each)."""
    from transformers import AutoTokenizer

    return encode(AutoTokenizer.from_pretrained(model_dir), PROMPTS * 32)


def test_seeded_long_prompts_generate(seeded, long_prompts: dict) -> None:
    """vLLM-CPU fails a step that chunks a seeded prefill ("CPU Generator does not use
    offset"); rollgen's CPU engines prefill whole prompts."""
    seeds = {**long_prompts, "seed": torch.arange(64) + 7}
    first, again = seeded.generate(seeds), seeded.generate(seeds)
    assert first["output_ids"].shape[0] == 64
    assert torch.equal(first["output_ids"], again["output_ids"])
    seeded.generate(long_prompts)  # seeds drawn from the config's


def test_seeded_long_prompts_stream(seeded, long_prompts: dict) -> None:
    results = seeded.submit(long_prompts).wait()
    assert len(results) == 64 and all(r.token_ids for r in results)


def test_a_keep_update_continues_seeded_long_samples(seeded, long_prompts: dict, model_dir: str) -> None:
    """A ``keep`` refit with seeded samples of long prompts running: each continues from its
    prompt plus its tokens (a longer prefill again) and ends as usual."""
    policy, version = load_reference_model(model_dir), seeded.weight_version
    rollout = seeded.submit({**long_prompts, "max_new_tokens": torch.full((64,), 40)})
    seeded.refit(policy, mode="keep")
    results = rollout.wait()
    assert all(r.stop_reason != "aborted" for r in results)
    assert all(len(r.token_ids) == len(r.logprobs) for r in results)
    assert seeded.weight_version == version + 1


def test_an_abort_update_ends_only_the_samples_that_started(
    seeded, short_prompts: dict, model_dir: str
) -> None:
    """``abort`` ends the samples running on the engines (``MAX_NUM_SEQS`` each at most); those
    still waiting on the driver for a replica start under the new weights."""
    n, slots = short_prompts["input_ids"].shape[0], MAX_NUM_SEQS * seeded.dp_size
    assert n > slots
    policy, version = load_reference_model(model_dir), seeded.weight_version
    rollout = seeded.submit({**short_prompts, "max_new_tokens": torch.full((n,), 64)})
    seeded.refit(policy, mode="abort")
    results = rollout.wait()
    aborted = [r for r in results if r.stop_reason == "aborted"]
    assert len(aborted) <= slots, f"{len(aborted)} aborted, but only {slots} can have started"
    assert all(r.versions == ((version, 0),) for r in aborted)
    # every sample ran to its end before the update, was aborted, or started after it
    ended_before = [r for r in results if r.stop_reason != "aborted" and r.versions == ((version, 0),)]
    later = [r for r in results if r.versions == ((version + 1, 0),)]
    assert len(ended_before) + len(aborted) + len(later) == n
    assert all(r.token_ids and r.stop_reason != "aborted" for r in later)


def test_a_replica_that_dies_under_a_streamed_rollout_ends_the_generation(
    seeded, short_prompts: dict
) -> None:
    """One of two replicas killed while a rollout streams: the rollout fails, ``usable`` is
    False and ``generate`` raises the death, as after any worker's death. (The module's last
    use of ``seeded``.)"""
    n = short_prompts["input_ids"].shape[0]
    rollout = seeded.submit({**short_prompts, "max_new_tokens": torch.full((n,), 200)})
    assert not rollout.done
    ray.kill(seeded.engines.group.workers[1], no_restart=True)
    with pytest.raises(rollgen.RollgenError, match="rollgen-vllm-dp1"):
        rollout.wait()
    assert not seeded.usable
    with pytest.raises(WorkerError, match="rollgen-vllm-dp1") as info:
        seeded.generate(short_prompts)
    assert info.value.died


def test_a_call_that_meets_a_dead_engine_core_fails_as_the_workers_death(
    model_dir: str, short_prompts: dict
) -> None:
    """The engine core SIGKILLed while the worker's watcher would not look for an hour (the
    stand-in), and once vLLM has seen it: the next generate meets vLLM's ``EngineDeadError``, on
    which the worker exits, so the call fails as its death (it was an error of the call, the
    generation still usable)."""
    from rollgen.config import validate_config
    from rollgen.testing.faults import kill_process
    from rollgen_vllm.config import VllmConfig
    from tests.vllm_faults import UnwatchedGeneration, engine_core

    cfg = tiny_config("vllm", model_dir, vllm_cfg={**ENGINE, "in_process": False})
    gen = UnwatchedGeneration(validate_config(cfg, VllmConfig))
    try:
        gen.generate(short_prompts, greedy=True)
        kill_process(engine_core(gen.engines.info(0)["pid"]))
        worker = gen.engines.group.workers[0]
        wait_until(lambda: ray.get(worker.engine_seen_dead.remote()), "vLLM saw its engine core end")
        with pytest.raises(WorkerError, match="rollgen-vllm-dp0: died") as info:
            gen.generate(short_prompts, greedy=True)
        assert info.value.died and not gen.usable
    finally:
        gen.shutdown()


def wedging(model_dir: str, **engine: object):
    """A generation on the ``WedgingWorker`` stand-in (real vLLM until told to hang)."""
    from rollgen.config import validate_config
    from rollgen_vllm.config import VllmConfig
    from tests.vllm_faults import WedgingGeneration

    # vLLM-CPU's own default (chunked prefill) fails seeded long prompts: a real engine failure
    cfg = tiny_config(
        "vllm", model_dir, vllm_cfg={**ENGINE, **engine}, vllm_kwargs={"enable_chunked_prefill": True}
    )
    return WedgingGeneration(validate_config(cfg, VllmConfig))


def test_a_failed_generate_leaves_the_engine_usable_and_shutdown_does_not_wait_on_a_wedged_call(
    model_dir: str, long_prompts: dict, short_prompts: dict, monkeypatch
) -> None:
    """A generate that vLLM fails (its seeded chunked prefill on CPU) raises a WorkerError and
    leaves nothing in the engine: the next generate runs. Then a generate that hangs in the
    engine (the stand-in) holds the generation's lock: ``shutdown()`` waits for it a bounded
    time (``shutdown_wait_s``, short here), then kills the engine, so the hung call fails with
    the worker's death."""
    import threading

    gen = wedging(model_dir)
    try:
        with pytest.raises(WorkerError, match="CPU Generator does not use offset") as info:
            gen.generate(long_prompts)
        assert not info.value.died and gen.usable
        assert gen.generate(short_prompts, greedy=True)["output_ids"].shape[0] == len(PROMPTS) * 32

        ray.get(gen.engines.group.workers[0].wedge.remote())
        monkeypatch.setattr(gen, "shutdown_wait_s", 1.0)
        calling, failed = threading.Event(), []
        group = gen.engines.group
        answers = group.answers  # reached once the call is sent, with the lock held
        monkeypatch.setattr(group, "answers", lambda *a, **k: (calling.set(), answers(*a, **k))[1])

        def call() -> None:
            try:
                gen.generate(short_prompts)
            except WorkerError as exc:
                failed.append(exc)

        caller = threading.Thread(target=call)
        caller.start()
        assert calling.wait(SAFETY_S)  # the call holds the lock and is sent
        gen.shutdown()
        caller.join()
        assert len(failed) == 1 and failed[0].died
        assert not gen.usable
    finally:
        gen.shutdown()


def test_a_wedged_call_fails_at_the_deadline_and_ends_the_generation(
    model_dir: str, short_prompts: dict
) -> None:
    """A generate that never comes back (the stand-in) raises ``WorkerError(died=True)`` once
    ``call_timeout_s`` (short here) has passed, its worker killed; later calls raise at once."""
    gen = wedging(model_dir, call_timeout_s=5.0)
    try:
        ray.get(gen.engines.group.workers[0].wedge.remote())
        with pytest.raises(WorkerError, match="call_timeout_s=5.0") as info:
            gen.generate(short_prompts)
        assert info.value.died and not gen.usable
        with pytest.raises(WorkerError, match="died earlier"):
            gen.generate(short_prompts)
    finally:
        gen.shutdown()
