"""A fleet that survives losing an engine (``engine_failures: "replace"``) on real vLLM (vllm-cpu
in CI), DP=2, one generation for the module: a replica killed (SIGKILL of its engine's process;
on CPU the engine core runs in the actor's process) before a call, or inside one (a stand-in,
``vllm_faults.DyingRank``, kills it at a chosen engine step), is replaced, what it held is re-run
on the survivor, and the replacement serves only once it holds the current weights.
test_fleet_production.py holds the engine core in a process of its own."""

import importlib.util
import random

import pytest
import torch

import rollgen
from rollgen.distributed.fleet import RetainedWeights
from rollgen.testing import load_reference_model
from rollgen.testing.chaos import Workload, run_round
from rollgen.testing.faults import kill_replica
from rollgen.testing.prompts import PROMPTS, encode
from rollgen.testing.reference import one_token_model, perturbed_model
from tests.vllm_faults import arm_death, fleet_config

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm not installed")

#: Long enough for every replacement of the module to start (a vLLM-CPU engine: 2-60 s).
START_S = 600


@pytest.fixture(scope="module")
def batch(model_dir: str) -> dict:
    from transformers import AutoTokenizer

    return encode(AutoTokenizer.from_pretrained(model_dir), PROMPTS * 2)


@pytest.fixture(scope="module")
def fleet(hf_config: dict):
    with rollgen.create_generation(fleet_config(hf_config, in_process=True, seed=11)) as gen:
        yield gen


def restored(gen, index: int, restarts: int) -> None:
    status = gen.restore_replicas(timeout_s=START_S)[index]
    assert status.state == "healthy", status
    assert status.restarts == restarts and status.weight_version == gen.weight_version, status
    assert gen.usable and gen.engines.live == [0, 1]


def test_a_replica_killed_before_generate_is_re_run_on_the_survivor_and_replaced(fleet, batch: dict) -> None:
    clean = fleet.generate(batch, greedy=True)
    seeded = {**batch, "seed": torch.arange(batch["input_ids"].shape[0]) + 100}
    clean_seeded = fleet.generate(seeded)
    assert [r.state for r in fleet.replicas] == ["healthy", "healthy"]
    kill_replica(fleet, 1)
    # the call that meets the death re-runs the dead replica's shard with its samples' seeds
    assert torch.equal(fleet.generate(seeded)["output_ids"], clean_seeded["output_ids"])
    out = fleet.generate(batch, greedy=True)  # on the survivor alone
    assert torch.equal(out["output_ids"], clean["output_ids"])
    assert torch.allclose(out["logprobs"], clean["logprobs"], atol=1e-5)
    assert fleet.usable and fleet.replicas[1].state in ("starting", "stale", "healthy")
    assert fleet.replicas[1].last_error and "rollgen-vllm-dp1" in fleet.replicas[1].last_error
    restored(fleet, 1, restarts=1)
    # both replicas serve again, the new one as the old one did (per-sample seeds included)
    assert torch.equal(fleet.generate(batch, greedy=True)["output_ids"], clean["output_ids"])
    assert torch.equal(fleet.generate(seeded)["output_ids"], clean_seeded["output_ids"])


def test_refits_while_the_replacement_starts_bring_it_to_the_latest_version(
    fleet, batch: dict, model_dir: str
) -> None:
    """Killed, then updated twice before its replacement is admitted (a refit, then buckets
    packed as a trainer in another process packs them): the replacement serves the second
    update's weights (not its start-up ones, not the first update's)."""
    start = fleet.generate(batch, greedy=True)["output_ids"]
    kill_replica(fleet, 0)
    a, b = perturbed_model(model_dir, 1), perturbed_model(model_dir, 2)
    try:
        fleet.refit(a)  # meets the death (the replica's refit channel closed): run again on the other
        assert fleet.updates.stale is None and fleet.usable
        assert (
            fleet.replicas[0].state != "healthy" and fleet.replicas[1].weight_version == fleet.weight_version
        )
        fleet.update_weights(rollgen.iter_buckets(b, "shared_memory", bucket_bytes=256 << 10))
        restored(fleet, 0, restarts=1)
        twice = {k: torch.cat([v, v]) for k, v in batch.items()}  # one copy on each replica
        out_b = fleet.generate(twice, greedy=True)["output_ids"]
        half = batch["input_ids"].shape[0]
        assert torch.equal(out_b[:half], out_b[half:])  # the new replica (first half) serves b
        assert not torch.equal(out_b[:half], start)
        fleet.refit(a)
        assert not torch.equal(fleet.generate(batch, greedy=True)["output_ids"], out_b[:half])
    finally:
        fleet.refit(load_reference_model(model_dir))


def test_streamed_samples_of_a_killed_replica_are_reported_once(fleet, batch: dict) -> None:
    """Samples running on, or sent to, a killed replica restart on the survivor (their results
    say so); each sample is reported once, with the tokens a fault-free run makes."""
    clean = fleet.generate(batch, greedy=True)
    size = batch["input_ids"].shape[0]
    first = fleet.submit(batch, greedy=True)
    kill_replica(fleet, 0)
    second = fleet.submit(batch, greedy=True)  # some of its samples go to the dead replica
    results = first.wait() + second.wait()
    assert sorted(r.index for r in results) == sorted(list(range(size)) * 2)
    assert sum(r.restarts for r in results) >= 1
    lengths = clean["generation_lengths"].tolist()
    for r in results:
        assert (
            r.token_ids
            == clean["output_ids"][r.index, batch["input_lengths"][r.index] :][: lengths[r.index]].tolist()
        )
    restored(fleet, 0, restarts=2)


def test_a_replica_killed_inside_generate_leaves_the_output_complete(fleet, batch: dict) -> None:
    """Replica 1 dies at its third engine step of the call (its shard half decoded): the call
    returns the whole batch's fault-free greedy output (the shard re-run on the survivor)."""
    clean = fleet.generate(batch, greedy=True)
    arm_death(fleet, 1, steps=3)
    out = fleet.generate(batch, greedy=True)
    assert torch.equal(out["output_ids"], clean["output_ids"])
    assert torch.equal(out["generation_lengths"], clean["generation_lengths"])
    assert fleet.replicas[1].state != "healthy" and "rollgen-vllm-dp1" in fleet.replicas[1].last_error
    restored(fleet, 1, restarts=2)


def test_a_replica_killed_inside_a_streamed_rollout_reports_each_sample_once(fleet, batch: dict) -> None:
    """Replica 0 dies at its second engine step, its samples running: each sample comes back
    once, with the fault-free tokens, stamped with the current version; those it held say
    they restarted."""
    clean = fleet.generate(batch, greedy=True)
    arm_death(fleet, 0, steps=2)
    results = fleet.submit(batch, greedy=True).wait()
    assert sorted(r.index for r in results) == list(range(batch["input_ids"].shape[0]))
    assert sum(r.restarts for r in results) >= 1
    lengths = clean["generation_lengths"].tolist()
    for r in results:
        start = int(batch["input_lengths"][r.index])
        assert r.token_ids == clean["output_ids"][r.index, start:][: lengths[r.index]].tolist()
        assert r.versions == ((fleet.weight_version, 0),)
    restored(fleet, 0, restarts=3)


def test_a_replica_killed_inside_a_keep_update_leaves_no_sample_aborted(
    fleet, batch: dict, model_dir: str
) -> None:
    """Replica 1 dies as it loads the first bucket of a ``keep`` refit that holds a streamed
    rollout's samples: the update runs again on the survivor inside the same hold, so the held
    samples continue under the new version (none ends ``aborted`` with the tokens it had) and
    each is reported once. On ``one_token_model`` weights every sample runs to its budget, all
    one token, and the update's weights emit another: each segment's tokens are its version's."""
    size, budget = batch["input_ids"].shape[0], 40
    long = {**batch, "max_new_tokens": torch.full((size,), budget)}
    old, new = 50, 60
    fleet.refit(one_token_model(model_dir, old))
    before, running = [s.restarts for s in fleet.replicas], fleet.weight_version
    arm_death(fleet, 1, buckets=1)
    rollout = fleet.submit(long, greedy=True)
    try:
        fleet.refit(one_token_model(model_dir, new), mode="keep")
        assert fleet.weight_version == running + 1 and fleet.updates.stale is None and fleet.usable
        results = rollout.wait()
    finally:
        fleet.refit(load_reference_model(model_dir))
    assert sorted(r.index for r in results) == list(range(size))
    token_of = {running: old, running + 1: new}
    for r in results:
        assert r.stop_reason not in ("aborted", "cancelled") and len(r.token_ids) == budget, r
        assert [v for v, _ in r.versions] in ([running], [running, running + 1], [running + 1]), r
        starts = [start for _, start in r.versions] + [budget]
        for (version, start), end in zip(r.versions, starts[1:]):
            assert set(r.token_ids[start:end]) <= {token_of[version]}, r
    assert fleet.replicas[1].restarts == before[1] + 1  # it died inside the update
    restored(fleet, 1, restarts=before[1] + 1)


def test_chaos_a_training_loop_losing_a_replica_every_round(fleet, model_dir: str) -> None:
    """The chaos rounds (``rollgen.testing.chaos``, as ``benchmarks.chaos`` runs them), each
    replica death landing inside the round's call (its second engine step): refits, generate,
    streamed rollouts; no sample lost or repeated, every token stamped with a version current
    when it was made and the tokens of that version's weights, each replacement restored."""
    work = Workload.make(fleet, model_dir)
    rng = random.Random(3)
    # generate, stream, stream with a keep update in flight, and again
    for n in range(6):
        before = [s.restarts for s in fleet.replicas]
        round_ = run_round(fleet, work, n, rng, lambda gen, victim, _: arm_death(gen, victim, steps=2))
        assert not round_["problems"], round_
        status = fleet.restore_replicas(timeout_s=START_S)
        assert all(s.state == "healthy" and s.weight_version == fleet.weight_version for s in status), status
        before[round_["victim"]] += 1  # it died inside the round, and only it
        assert [s.restarts for s in status] == before, status


def test_retained_weights_keep_the_latest_value_of_every_tensor() -> None:
    kept = RetainedWeights()
    assert kept.why_not_current(0) is None and kept.buckets("tensors") == []
    kept.keep([("a", torch.ones(2)), ("b", torch.ones(2))], partial=False, version=1)
    kept.keep([("b", torch.zeros(2))], partial=True, version=2)
    assert kept.why_not_current(1) is not None and kept.why_not_current(2) is None
    (bucket,) = kept.buckets("tensors")
    assert {n: t.tolist() for n, t in bucket.unpack()} == {"a": [1.0, 1.0], "b": [0.0, 0.0]}
    kept.lose("came over a weight-sync group", 3)
    assert kept.why_not_current(3) == "came over a weight-sync group"
    kept.keep([("a", torch.ones(2))], partial=False, version=4)
    assert kept.why_not_current(4) is None and set(kept.tensors) == {"a"}


def test_a_replica_past_its_restart_limit_stays_out_and_losing_all_ends_the_generation(
    fleet, batch: dict, caplog: pytest.LogCaptureFixture
) -> None:
    """(The module's last use of ``fleet``.) Replica 0 at its limit (the fleet's setting,
    lowered here to the restarts it has had) stays out when killed again; the survivor serves
    alone; once it dies too, the generation ends as with ``engine_failures: "fail"``."""
    clean = fleet.generate(batch, greedy=True)
    fleet.fleet.max_restarts = fleet.replicas[0].restarts
    kill_replica(fleet, 0)
    with caplog.at_level("INFO", logger="rollgen.distributed.replicas"):
        assert torch.equal(fleet.generate(batch, greedy=True)["output_ids"], clean["output_ids"])
    status = fleet.restore_replicas(timeout_s=0)[0]
    assert status.state == "dead" and "stays out" in status.last_error, status
    assert fleet.engines.live == [1] and fleet.usable
    assert any("rollgen-vllm-dp0 healthy -> dead" in r.getMessage() for r in caplog.records)
    kill_replica(fleet, 1)
    with pytest.raises(rollgen.WorkerError, match="rollgen-vllm-dp1") as info:
        fleet.generate(batch, greedy=True)
    assert info.value.died and not fleet.usable
