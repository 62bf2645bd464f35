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
