"""The ``hf-ray`` backend's own rules (the conformance suite holds it to the contract in
``make test``, at DP=2 with ``engine_failures: "replace"``)."""

import pytest

import rollgen
from rollgen.errors import ConfigError


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
