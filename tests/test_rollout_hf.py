"""Streamed rollouts on the hf backend (a real engine, the tiny model on CPU): weight versions,
groups over one queue, replicas, ``generate`` while a rollout is in flight."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch
from rollout_standins import prompts_batch

import rollgen
from rollgen.errors import InputError, RolloutsInFlight
from rollgen.output import STOP_REASONS
from rollgen.rollout import Rollout, SampleResult
from rollgen.testing.config import tiny_config


# ---- the hf backend -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def hf_engine() -> Any:
    with rollgen.create_generation(tiny_config("hf", dtype="float32", hf_cfg={"device": "cpu"})) as gen:
        yield gen


def test_hf_weight_version_counts_refits_and_stamps_streamed_tokens(hf_engine: Any) -> None:
    engine = hf_engine
    state = {k: v.detach().clone() for k, v in engine.model.state_dict().items()}
    before = engine.weight_version
    engine.refit(state)
    assert engine.weight_version == before + 1
    engine.refit(state)
    assert engine.weight_version == before + 2
    with pytest.raises(InputError):
        engine.refit(state, mode="sometimes")
    assert engine.weight_version == before + 2, "a rejected refit is not counted"

    batch = prompts_batch([5, 6, 7], [8, 9], pad=engine.cfg["pad_token_id"])
    out = engine.submit(batch, greedy=True).output()
    assert out["weight_versions"] == [((before + 2, 0),)] * 2
    expected = engine.generate(batch, greedy=True)
    assert torch.equal(out["output_ids"], expected["output_ids"])
    assert out["stop_reasons"] == expected["stop_reasons"]


def test_hf_rollouts_feeding_one_queue_in_whole_groups(hf_engine: Any) -> None:
    """Two tagged rollouts of two prompts times two samples each, forwarded group by group into
    one asyncio queue (as an async GRPO trainer takes them): every group whole, each result
    naming its rollout."""
    engine = hf_engine
    batch = prompts_batch([5, 6, 7], [5, 6, 7], [8, 9], [8, 9], pad=engine.cfg["pad_token_id"])

    async def run() -> list[list[SampleResult]]:
        queue: asyncio.Queue[list[SampleResult]] = asyncio.Queue()

        async def forward(rollout: Rollout) -> None:
            async for group in rollout.groups(2):
                await queue.put(group)

        rollouts = [engine.submit(batch, tag=f"step-{i}") for i in range(2)]
        await asyncio.gather(*(forward(r) for r in rollouts))
        return [queue.get_nowait() for _ in range(queue.qsize())]

    groups = asyncio.run(run())
    assert sorted((g[0].tag, [r.index for r in g]) for g in groups) == [
        ("step-0", [0, 1]),
        ("step-0", [2, 3]),
        ("step-1", [0, 1]),
        ("step-1", [2, 3]),
    ]
    assert all(len({r.rollout_id for r in g}) == 1 and all(r.token_ids for r in g) for g in groups)


def test_hf_takes_replica_0_or_none_and_reports_no_replica(hf_engine: Any) -> None:
    batch = prompts_batch([5, 6, 7], pad=hf_engine.cfg["pad_token_id"])
    for bad in (1, -1, True, "0"):
        with pytest.raises(InputError, match="replica"):
            hf_engine.submit(batch, replica=bad)
    assert hf_engine.replica_load() == []
    (result,) = hf_engine.submit(batch, greedy=True, replica=0).wait()
    assert result.replica is None and result.token_ids


def test_hf_generate_raises_while_a_rollout_is_in_flight(hf_engine: Any) -> None:
    engine = hf_engine
    batch = prompts_batch([5, 6, 7], pad=engine.cfg["pad_token_id"])
    # Holding the core's book lock (re-entrant) keeps the decoding thread from reporting the
    # sample, so it is in flight whatever the machine's speed; released, the sample ends.
    with engine._streams._cond:
        rollout = engine.submit(batch, greedy=True)
        with pytest.raises(RolloutsInFlight):
            engine.generate(batch, greedy=True)
        with pytest.raises(RolloutsInFlight):
            engine.finish_generation()
        assert not rollout.done
    (result,) = rollout.wait()
    assert result.stop_reason in STOP_REASONS and result.token_ids
    expected = engine.generate(batch, greedy=True)
    assert expected["output_ids"][0, 3 : 3 + len(result.token_ids)].tolist() == result.token_ids
    assert expected["stop_reasons"] == [result.stop_reason]
