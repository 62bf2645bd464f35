"""A fleet that survives losing a replica, for backends that declare ``data_parallel`` run with
``engine_failures: "replace"`` and two replicas or more: a killed replica is replaced, the work
it held finishes on the others, its replacement serves only the current weights, and
``replicas`` reports each step. A replica is killed as an engine dies (SIGKILL of its engine's
process, ``rollgen.testing.faults.kill_replica``). Each test ends with every replica back in
service on the engine's original weights."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from rollgen.conformance.checks import assert_same_generation, assert_same_tokens, can_refit
from rollgen.rollout import TokenDelta
from rollgen.spec import Capability
from rollgen.testing.faults import kill_replica

#: Seconds a test waits for a replacement to start and catch up.
RESTORE_S = 600.0


def replacing(config: dict[str, Any]) -> bool:
    """Whether ``config`` asks an engine sub-dict for ``engine_failures: "replace"``."""
    return any(isinstance(v, dict) and v.get("engine_failures") == "replace" for v in config.values())


def once_per_replica(batch: dict[str, torch.Tensor], replicas: int) -> dict[str, torch.Tensor]:
    """``batch`` repeated ``replicas`` times: sharded over as many replicas, each gets one copy."""
    return {k: torch.cat([v] * replicas) for k, v in batch.items()}


class FleetTests:
    """Replica deaths on the shared engine; each test restores it."""

    __requires__ = ("data_parallel",)

    def fleet_size(self, engine: Any, caps: frozenset[Capability], base_config: dict[str, Any]) -> int:
        """The number of replicas, or skip: the backend does not declare ``data_parallel``, the
        config does not ask ``engine_failures: "replace"``, or runs one replica."""
        if Capability.DATA_PARALLEL not in caps:
            pytest.skip("data_parallel not declared: no replicas to lose")
        if not replacing(base_config):
            pytest.skip('the config does not ask engine_failures: "replace" (a death ends the generation)')
        count = len(engine.replicas)
        if count < 2:
            pytest.skip(f"{count} replica: a fleet needs data_parallel_size of 2 or more")
        return count

    def all_restored(self, engine: Any, count: int) -> None:
        """Every replica back in service, at the engine's current weight version."""
        status = engine.restore_replicas(timeout_s=RESTORE_S)
        assert [s.state for s in status] == ["healthy"] * count, f"not every replica came back: {status}"
        assert all(s.weight_version == engine.weight_version for s in status), (
            f"a replica back in service is not at weight version {engine.weight_version}: {status}"
        )

    def test_a_killed_replica_is_replaced_and_its_work_finishes_elsewhere(
        self,
        request: pytest.FixtureRequest,
        engine: Any,
        caps: frozenset[Capability],
        base_config: dict[str, Any],
        batch: dict[str, torch.Tensor],
        greedy_out: dict[str, torch.Tensor],
    ) -> None:
        count = self.fleet_size(engine, caps, base_config)
        victim = count - 1
        before = engine.replicas[victim]
        assert before.state == "healthy", f"replica {victim} out of service before the test: {before}"
        kill_replica(engine, victim)
        assert_same_generation(request, "after_a_death", engine.generate(batch, greedy=True), greedy_out)
        assert engine.usable, "a death the other replicas survive ended the generation"
        dead = engine.replicas[victim]
        assert dead.state in ("dead", "starting", "stale"), f"the killed replica is reported {dead}"
        assert dead.restarts == before.restarts + 1 and dead.last_error, (
            f"the killed replica's replacement or its death is not reported: {dead}"
        )
        self.all_restored(engine, count)
        out = engine.generate(once_per_replica(batch, count), greedy=True)
        for copy in out["output_ids"].chunk(count):
            assert_same_tokens("each replica, the replacement too", copy, greedy_out["output_ids"])

    def test_a_replacement_serves_the_weights_of_updates_made_while_it_started(
        self,
        engine: Any,
        caps: frozenset[Capability],
        base_config: dict[str, Any],
        references: Callable[[str, str], Any],
        model_dir: str,
        other_model_dir: str,
        batch: dict[str, torch.Tensor],
        greedy_out: dict[str, torch.Tensor],
    ) -> None:
        count = self.fleet_size(engine, caps, base_config)
        if not can_refit(caps):
            pytest.skip("no refit declared: the weights never change")
        kill_replica(engine, 0)
        try:
            engine.refit(references(other_model_dir, "float32"))  # the death met, or not yet
            engine.refit(references(model_dir, "float32"))
            engine.refit(references(other_model_dir, "float32"))
            assert engine.usable and engine.replicas[0].state != "healthy", engine.replicas
            with_new = engine.generate(batch, greedy=True)["output_ids"]
            self.all_restored(engine, count)
            out = engine.generate(once_per_replica(batch, count), greedy=True)["output_ids"]
            for copy in out.chunk(count):
                assert_same_tokens("the replacement serves the latest update's weights", copy, with_new)
        finally:
            engine.refit(references(model_dir, "float32"))
        self.all_restored(engine, count)
        assert_same_tokens(
            "back on the original weights",
            engine.generate(batch, greedy=True)["output_ids"],
            greedy_out["output_ids"],
        )

    def test_streamed_samples_of_a_killed_replica_come_back_once(
        self,
        engine: Any,
        caps: frozenset[Capability],
        base_config: dict[str, Any],
        batch: dict[str, torch.Tensor],
        greedy_out: dict[str, torch.Tensor],
    ) -> None:
        count = self.fleet_size(engine, caps, base_config)
        if Capability.ASYNC not in caps:
            pytest.skip("async not declared: no streamed samples")
        size = batch["input_ids"].shape[0]
        first = engine.submit(batch, greedy=True)
        streamed = engine.submit(batch, greedy=True, stream_tokens=True)
        kill_replica(engine, 0)
        second = engine.submit(batch, greedy=True)  # some of it sent to the dead replica
        shown: dict[int, list[int]] = {i: [] for i in range(size)}
        for event in streamed.events():
            if isinstance(event, TokenDelta):
                assert event.start == len(shown[event.index]), (
                    f"sample {event.index}: a delta at {event.start} after {len(shown[event.index])} tokens "
                    "(a restarted sample must continue from the tokens it streamed, never take them back)"
                )
                shown[event.index] += event.token_ids
        results = first.wait() + second.wait() + streamed.wait()
        assert all(shown[r.index] == r.token_ids for r in streamed.wait()), (shown, streamed.wait())
        assert sorted(r.index for r in results) == sorted(list(range(size)) * 3), (
            f"samples reported {sorted(r.index for r in results)}: each of the rollouts' must come once"
        )
        start, lengths = batch["input_lengths"].tolist(), greedy_out["generation_lengths"].tolist()
        for r in results:
            want = greedy_out["output_ids"][r.index, start[r.index] :][: lengths[r.index]].tolist()
            assert r.token_ids == want, f"{r} differs from generate's {want}"
            assert r.versions == ((engine.weight_version, 0),), r
        self.all_restored(engine, count)
