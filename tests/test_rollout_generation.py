"""``BaseGeneration`` over the streams: what may not run while samples stream, the capability,
refits meeting samples in flight, ``wait_ready``, shutdown, a NaN logprob. On the stand-in
generations of ``rollout_standins`` (the tiny model's config, no engine)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from rollout_standins import (
    ALL_CAPS,
    InThread,
    PlainGeneration,
    StandInGeneration,
    make,
    prompts_batch,
    zero_weights,
)

import rollgen
from rollgen import Capability, GenerationConfig
from rollgen.config import validate_config
from rollgen.errors import InputError, RefitError, RolloutsInFlight, StaleWeights, UnsupportedCapability
from rollgen.output import STOP_REASONS
from rollgen.testing.config import tiny_config


@pytest.fixture(scope="module")
def standin_config() -> dict[str, Any]:
    return validate_config(tiny_config("standin", dtype="float32"), GenerationConfig)


def test_generate_and_sleep_raise_while_streamed_samples_are_in_flight(standin_config: dict) -> None:
    gen = make(StandInGeneration, standin_config)
    pad = standin_config["pad_token_id"]
    eos = gen.model_info.eos_token_ids[0]
    batch = prompts_batch([5, 6, 7], [8], pad=pad)
    rollout = gen.submit(batch, greedy=True)
    a, b = gen.rec.started
    assert a.prompt_ids == (5, 6, 7) and b.prompt_ids == (8,)
    with pytest.raises(RolloutsInFlight, match="2 streamed sample"):
        gen.generate(batch)
    with pytest.raises(RolloutsInFlight, match="finish_generation"):
        gen.finish_generation()

    rollout.cancel()  # a cancel asks the engine; the samples are in flight until it reports them
    with pytest.raises(RolloutsInFlight):
        gen.generate(batch)
    gen.rec.finish(a, (10,), aborted=True)
    with pytest.raises(RolloutsInFlight, match="1 streamed sample"):
        gen.generate(batch)
    gen.rec.finish(b, (11, eos))
    assert [r.stop_reason for r in rollout.wait()] == ["cancelled", "eos"]

    out = gen.generate(batch)
    assert out["generation_lengths"].tolist() == [1, 1]
    gen.finish_generation()
    gen.shutdown()


def test_submit_needs_the_async_capability(standin_config: dict) -> None:
    no_async = make(StandInGeneration, standin_config, ALL_CAPS - {Capability.ASYNC})
    batch = prompts_batch([5, 6], pad=standin_config["pad_token_id"])
    with pytest.raises(UnsupportedCapability, match="async"):
        no_async.submit(batch)
    assert no_async.rec.started == [] and no_async._streams.in_flight == 0
    assert no_async.generate(batch)["generation_lengths"].tolist() == [1]

    # a backend that declares async without implementing the hooks fails the submit cleanly
    no_hooks = make(PlainGeneration, standin_config)
    with pytest.raises(UnsupportedCapability, match="async"):
        no_hooks.submit(batch)
    assert no_hooks.generate(batch)["generation_lengths"].tolist() == [1], "nothing left in flight"


def test_submit_on_the_example_backend_raises_unsupported_capability() -> None:
    pytest.importorskip("rollgen_example")
    with rollgen.create_generation(tiny_config("example", max_new_tokens=2)) as gen:
        assert Capability.ASYNC not in gen.capabilities
        batch = prompts_batch([5, 6], pad=gen.cfg["pad_token_id"])
        with pytest.raises(UnsupportedCapability, match="async"):
            gen.submit(batch)
        assert gen.weight_version == 0


def test_refit_waits_by_default_for_samples_in_flight(standin_config: dict) -> None:
    gen = make(StandInGeneration, standin_config)
    source = zero_weights(gen)
    eos = gen.model_info.eos_token_ids[0]
    rollout = gen.submit(prompts_batch([5, 6], pad=standin_config["pad_token_id"]), greedy=True)
    (a,) = gen.rec.started
    refit = InThread(lambda: gen.refit(source))
    assert refit.still_blocked(), "refit did not wait for the sample in flight"
    assert gen.applied == 0 and gen.weight_version == 0 and gen.rec.abort_calls == []
    gen.rec.finish(a, (10, eos))
    refit.result()
    assert gen.applied > 0 and gen.weight_version == 1
    assert rollout.wait()[0].versions == ((0, 0),)


def test_refit_keep_continues_a_sample_under_the_new_version(standin_config: dict) -> None:
    gen = make(StandInGeneration, standin_config)
    source = zero_weights(gen)
    eos = gen.model_info.eos_token_ids[0]
    rollout = gen.submit(prompts_batch([5, 6, 7], pad=standin_config["pad_token_id"]), greedy=True)
    (a,) = gen.rec.started
    budget = a.params.max_new_tokens
    gen.rec.on_abort = lambda keys: gen.rec.finish(a, (10, 11), aborted=True)
    InThread(lambda: gen.refit(source, mode="keep")).result()  # the thread: a deadline if it hung
    assert gen.weight_version == 1 and gen.applied > 0
    assert gen.rec.abort_calls == [[a.key]]
    (a2,) = gen.rec.started[1:]
    assert a2.prompt_ids == (5, 6, 7, 10, 11) and a2.params.max_new_tokens == budget - 2
    gen.rec.finish(a2, (12, eos))
    (result,) = rollout.wait()
    assert result.token_ids == [10, 11, 12, eos] and result.stop_reason == "eos"
    assert result.versions == ((0, 0), (1, 2))
    assert rollout.output()["weight_versions"] == [((0, 0), (1, 2))]


def test_a_refit_failing_midway_ends_kept_samples_aborted_and_keeps_the_version(standin_config: dict) -> None:
    gen = make(StandInGeneration, standin_config)
    source = zero_weights(gen)
    batch = prompts_batch([5, 6], pad=standin_config["pad_token_id"])
    rollout = gen.submit(batch, greedy=True)
    (a,) = gen.rec.started
    gen.rec.on_abort = lambda keys: gen.rec.finish(a, (10,), aborted=True)
    gen.fail_apply = True
    with pytest.raises(RuntimeError, match="lost a bucket"):
        InThread(lambda: gen.refit(source, mode="keep")).result()
    assert gen.weight_version == 0
    assert len(gen.rec.started) == 1, "a stale engine restarts nothing"
    assert [(r.stop_reason, r.token_ids) for r in rollout.wait()] == [("aborted", [10])]
    with pytest.raises(StaleWeights):
        gen.submit(batch)
    gen.fail_apply = False
    gen.refit(source)  # a complete refit makes it fresh again
    assert gen.weight_version == 1
    gen.submit(batch)
    assert gen.rec.started[-1].prompt_ids == (5, 6)


def test_a_rejected_refit_leaves_samples_running(standin_config: dict) -> None:
    gen = make(StandInGeneration, standin_config)
    source = zero_weights(gen)
    rollout = gen.submit(prompts_batch([5, 6], pad=standin_config["pad_token_id"]))
    (a,) = gen.rec.started
    name = next(iter(source))
    with pytest.raises(RefitError):
        gen.refit({**source, name: torch.zeros(3, 3)}, mode="abort")
    with pytest.raises(InputError, match="bogus"):
        gen.refit(source, mode="bogus")
    assert gen.rec.abort_calls == [] and gen.weight_version == 0 and gen.applied == 0
    assert gen._streams.in_flight == 1
    gen.rec.finish(a, (10,), aborted=True)  # e.g. the engine stopped it on its own
    assert rollout.wait()[0].stop_reason in STOP_REASONS


def test_wait_ready_returns_once_woken_refitted_fresh_or_shut_down(standin_config: dict) -> None:
    """``wait_ready`` (what the server waits in for a sleeping engine): it returns when the
    trainer's call that makes the generation ready ends, or False once it never can be."""
    gen = make(PlainGeneration, standin_config)
    source = zero_weights(gen)
    assert gen.ready and gen.wait_ready(0)
    gen.finish_generation()
    assert not gen.ready and not gen.wait_ready(0)
    waiter = InThread(gen.wait_ready)
    gen.prepare_for_generation(["weights"])
    assert not gen.ready, "the KV cache is still asleep"
    gen.prepare_for_generation()
    assert waiter.result() is True

    gen.fail_apply = True
    with pytest.raises(RuntimeError, match="lost a bucket"):
        gen.refit(source)
    assert not gen.ready and not gen.wait_ready(0), "stale weights"
    waiter = InThread(gen.wait_ready)
    gen.fail_apply = False
    gen.refit(source)
    assert waiter.result() is True

    gen.finish_generation()
    waiter = InThread(gen.wait_ready)
    gen.shutdown()
    assert waiter.result() is False and not gen.ready


def test_shutdown_ends_streamed_samples_aborted(standin_config: dict) -> None:
    gen = make(StandInGeneration, standin_config)
    rollout = gen.submit(prompts_batch([5, 6], [7], pad=standin_config["pad_token_id"]))
    a, b = gen.rec.started

    def stop_both(keys: list[str]) -> None:
        for r in (a, b):
            gen.rec.finish(r, (10,), aborted=True)

    gen.rec.on_abort = stop_both
    gen.shutdown()
    assert sorted(gen.rec.abort_calls[0]) == sorted([a.key, b.key])
    assert [(r.stop_reason, r.token_ids) for r in rollout.wait()] == [("aborted", [10])] * 2
    gen.shutdown()  # a second shutdown does nothing
    assert len(gen.rec.abort_calls) == 1


def test_a_streamed_nan_logprob_makes_the_next_complete_refit_clear_the_kv_cache(
    standin_config: dict,
) -> None:
    class Clearing(StandInGeneration):
        cleared = 0

        def _clear_kv_cache(self) -> None:
            self.cleared += 1

    gen = make(Clearing, standin_config)
    eos = gen.model_info.eos_token_ids[0]
    rollout = gen.submit(prompts_batch([5, 6], pad=standin_config["pad_token_id"]), greedy=True)
    (a,) = gen.rec.started
    gen.rec.finish(a, (10, eos), (float("nan"), -0.2))
    assert rollout.wait()[0].logprobs[1] == -0.2
    source = zero_weights(gen)
    gen.refit(source, partial=False)
    assert gen.cleared == 1
    gen.refit(source)
    assert gen.cleared == 1, "the KV cache is cleared once, by the first complete refit after"
    gen.shutdown()
