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


def test_the_prefix_cache_is_keyed_by_version_unless_a_setting_ignores_the_key() -> None:
    """SGLang's radix caches key a request's prefix by its ``extra_key`` (the weight version),
    so refits flush nothing; its experimental C++ radix tree ignores the key (refits flush then),
    and HiCache's storage tier, which ignores it and survives a flush, is refused."""
    from rollgen_sglang.worker import keys_prefixes_by_version

    assert keys_prefixes_by_version({"tp_size": 1}, {}) is True
    assert keys_prefixes_by_version({"enable_hierarchical_cache": True}, {}) is True
    assert keys_prefixes_by_version({}, {"SGLANG_EXPERIMENTAL_CPP_RADIX_TREE": "1"}) is False
    assert keys_prefixes_by_version({}, {"SGLANG_EXPERIMENTAL_CPP_RADIX_TREE": "false"}) is True
    with pytest.raises(ConfigError, match="hicache_storage_backend"):
        keys_prefixes_by_version({"enable_hierarchical_cache": True, "hicache_storage_backend": "file"}, {})
