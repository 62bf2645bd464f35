"""A fleet refitted over a weight-sync group by a trainer in another process, through the death
of a replica (hf-ray, DP=2, ``engine_failures: "replace"``: real engines in Ray actors, a real
gloo group). A group's size is fixed, so the dead replica's group carries no further update; a
new group takes every replica, the replacement too, and a complete update over it puts the
replacement in service."""

import pytest
import torch

import rollgen
from rollgen.errors import RefitError
from rollgen.testing.faults import kill_replica
from rollgen.testing.prompts import PROMPTS, encode
from rollgen.testing.tiny_model import tiny_model_dir
from rollgen.testing.trainer import start_trainer


@pytest.fixture
def fleet(hf_config: dict):
    config = {
        **hf_config,
        "backend": "hf-ray",
        "hf_cfg": {"data_parallel_size": 2, "engine_failures": "replace", "cpus_per_bundle": 0.1},
    }
    with rollgen.create_generation(config) as gen:
        yield gen


def test_after_a_death_a_new_weight_sync_group_brings_the_replacement_into_service(
    fleet, model_dir: str
) -> None:
    from transformers import AutoTokenizer

    batch = encode(AutoTokenizer.from_pretrained(model_dir), PROMPTS)
    start = fleet.generate(batch, greedy=True)["output_ids"]
    other = tiny_model_dir(trained=False)
    trainer = start_trainer(
        fleet.weight_sync_spec("127.0.0.1"), [(other, None), (model_dir, None)], "float32"
    )
    try:
        fleet.init_weight_sync(trainer.spec)
        fleet.update_weights_from_collective()
        assert trainer.result() == "ok"
        with_other = fleet.generate(batch, greedy=True)["output_ids"]
        assert not torch.equal(with_other, start)

        kill_replica(fleet, 1)
        # the death is seen here: the dead replica's samples run again on the survivor
        assert torch.equal(fleet.generate(batch, greedy=True)["output_ids"], with_other)
        with pytest.raises(RefitError, match="rollgen-hf-ray-dp1 died since the weight-sync group formed"):
            fleet.update_weights_from_collective()  # nothing sent: the survivor keeps serving
        assert fleet.updates.stale is None
        assert torch.equal(fleet.generate(batch, greedy=True)["output_ids"], with_other)
    finally:
        trainer.kill()  # its second send waits on the lost group

    replaced = fleet.restore_replicas(timeout_s=None)[1]
    assert replaced.state == "stale" and "weight-sync group" in (replaced.last_error or ""), replaced

    # the replacement started with the start-up weights: only the new group can bring it `other`
    trainer = start_trainer(fleet.weight_sync_spec("127.0.0.1"), [(other, None)], "float32")
    try:
        fleet.init_weight_sync(trainer.spec)  # the stale replacement joins too
        fleet.update_weights_from_collective()
        assert trainer.result() == "ok"
    finally:
        trainer.kill()
    assert [(r.state, r.weight_version) for r in fleet.replicas] == [("healthy", fleet.weight_version)] * 2
    out = fleet.generate({k: torch.cat([v, v]) for k, v in batch.items()}, greedy=True)["output_ids"]
    half = batch["input_ids"].shape[0]
    assert torch.equal(out[:half], with_other) and torch.equal(out[half:], with_other)  # one on each
