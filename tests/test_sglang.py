"""The sglang backend where SGLang cannot be installed (CPU): registered, listed as unavailable
with the install hint, its config validated; no engine stands in for SGLang here."""

import importlib.util

import pytest

import rollgen
from rollgen import BackendUnavailable, ConfigError
from rollgen.config import validate_config
from rollgen.registry import get_registry
from rollgen_sglang.config import SglangConfig

needs_no_sglang = pytest.mark.skipif(
    importlib.util.find_spec("sglang") is not None, reason="sglang installed"
)


def test_registered_with_capabilities() -> None:
    entry = get_registry().get("sglang")
    assert entry.plugin.distribution == "rollgen-sglang"
    caps = {c.value for c in entry.backend.capabilities}
    assert {"logprobs", "refit_ipc", "sleep_wake", "tensor_parallel", "data_parallel"} <= caps
    assert "refit_tensors" not in caps, "SGLang refits from CUDA IPC handles only"


@needs_no_sglang
def test_listed_unavailable_with_install_hint(cli_backends: dict) -> None:
    row = cli_backends["sglang"]
    assert row["importable"] is False and row["status"] == "unavailable"
    assert "rollgen[sglang]" in row["reason"] and "sglang" in row["reason"]


@needs_no_sglang
def test_create_raises_unavailable_before_any_work(hf_config: dict) -> None:
    with pytest.raises(BackendUnavailable, match=r"rollgen\[sglang\]"):
        rollgen.create_generation({**hf_config, "backend": "sglang"})


def test_config_validation(hf_config: dict) -> None:
    good = {
        **hf_config,
        "backend": "sglang",
        "sglang_cfg": {"tensor_parallel_size": 2, "mem_fraction_static": 0.3},
    }
    assert validate_config(good, SglangConfig)["sglang_cfg"]["tensor_parallel_size"] == 2
    bad_cfg = {"mem_fraction_static": 1.5, "tp_size": 2, "sleep_on_idle": [1]}
    bad = {**hf_config, "backend": "sglang", "sglang_cfg": bad_cfg}
    with pytest.raises(ConfigError) as info:
        validate_config(bad, SglangConfig)
    assert len(info.value.problems) == 3
    assert any("tp_size" in p for p in info.value.problems)
