"""The ``hf-ray`` backend's own rules (the conformance suite holds it to the contract in
``make test``, at DP=2 with ``engine_failures: "replace"``)."""

from typing import Any

import pytest

import rollgen
from rollgen.errors import ConfigError, RollgenError, WorkerError
from tests.waiting import rollout_outcome


def test_tensor_parallelism_is_refused_before_any_engine_starts(hf_config: dict) -> None:
    config = {**hf_config, "backend": "hf-ray", "hf_cfg": {"tensor_parallel_size": 2}}
    with pytest.raises(ConfigError, match="data_parallel_size"):
        rollgen.create_generation(config)


def test_the_engine_config_is_validated_like_the_other_ray_backends(hf_config: dict) -> None:
    config = {**hf_config, "backend": "hf-ray", "hf_cfg": {"device": "cpu"}}
    with pytest.raises(ConfigError, match="device"):
        rollgen.create_generation(config)


def test_the_samples_submitted_with_a_cancelled_one_still_end(hf_config: dict, model_dir: str) -> None:
    """A sample cancelled at once, while the dispatcher has only queued its batch: the rest of
    its batch still runs to its end (it is not left queued until another submit comes). Each
    wait has a deadline, so that a stranded sample fails the test."""
    import threading

    from transformers import AutoTokenizer

    from rollgen.testing.prompts import PROMPTS, encode

    config = {**hf_config, "backend": "hf-ray", "hf_cfg": {"data_parallel_size": 1, "cpus_per_bundle": 0.1}}
    batch = encode(AutoTokenizer.from_pretrained(model_dir), PROMPTS[:2])
    with rollgen.create_generation(config) as gen:
        for _ in range(5):
            rollout = gen.submit(batch, greedy=True)
            rollout.cancel([0])
            results: list[rollgen.SampleResult] = []
            waiting = threading.Thread(target=lambda: results.extend(rollout.wait()), daemon=True)  # noqa: B023
            waiting.start()
            waiting.join(60)
            assert results, f"the rollout did not end; in flight: {gen.samples_in_flight()}"
            # the cancelled one may have ended on its own first (8 tokens); the other runs to its end
            assert len(results) == 2 and len(results[1].token_ids) > 0


def stuck(hf_config: dict, **engine: object) -> Any:
    """An hf-ray generation on the ``StuckWorker`` stand-in (replica 0 never ends a step)."""
    from rollgen.config import validate_config
    from rollgen_hf.config import HfRayConfig
    from tests.hf_faults import StuckGeneration

    config = {**hf_config, "backend": "hf-ray", "hf_cfg": {"cpus_per_bundle": 0.1, **engine}}
    return StuckGeneration(validate_config(config, HfRayConfig))


def prompts(model_dir: str) -> dict:
    from transformers import AutoTokenizer

    from rollgen.testing.prompts import PROMPTS, encode

    return encode(AutoTokenizer.from_pretrained(model_dir), PROMPTS[:2])


def test_an_engine_that_makes_no_token_for_call_timeout_s_is_killed_as_wedged(
    hf_config: dict, model_dir: str
) -> None:
    """A streamed sample on an engine stuck in a step fails once ``call_timeout_s`` (short
    here) has passed without a token, as that engine's death; not a rollout that never ends."""
    with stuck(hf_config, data_parallel_size=1, call_timeout_s=5.0) as gen:
        error = rollout_outcome(gen.submit(prompts(model_dir)))
        assert isinstance(error, RollgenError) and "made no token for call_timeout_s=5.0" in str(error)
        assert not gen.usable
        with pytest.raises(WorkerError, match="died earlier"):
            gen.generate(prompts(model_dir))


def test_the_samples_of_a_wedged_engine_run_again_on_the_others(hf_config: dict, model_dir: str) -> None:
    """With ``engine_failures: "replace"``, the samples of the engine killed as wedged restart
    on another replica and end there."""
    with stuck(hf_config, data_parallel_size=2, engine_failures="replace", call_timeout_s=5.0) as gen:
        results = rollout_outcome(gen.submit(prompts(model_dir), greedy=True, replica=0))
        assert isinstance(results, list), results
        assert all(r.token_ids and r.replica == 1 and r.restarts == 1 for r in results)
        first = gen.replicas[0]
        assert first.state != "healthy" and "made no token" in str(first.last_error)
