"""Entry point of the ``hf`` and ``hf-ray`` backends: registers them without importing
transformers or Ray."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from rollgen import Backend, Capability, hookimpl
from rollgen_hf.config import HfConfig, HfRayConfig

CAPABILITIES = frozenset(
    {
        Capability.TEXT,
        Capability.LOGPROBS,
        Capability.PROCESSED_LOGPROBS,
        Capability.STOP_STRINGS,
        Capability.PER_SAMPLE_SAMPLING,
        Capability.SLEEP_WAKE,
        Capability.REFIT_TENSORS,
        Capability.REFIT_COLLECTIVE,
        Capability.ASYNC,
    }
)


@hookimpl
def rollgen_register_backends(register: Callable[[Backend], None]) -> None:
    register(
        Backend(
            name="hf",
            factory="rollgen_hf.generation:HfGeneration",
            config_type=HfConfig,
            capabilities=CAPABILITIES | {Capability.ADAPTERS},
            requires=("transformers",),
            install_hint="pip install 'rollgen[hf]'",
            description="Hugging Face transformers, in process (reference implementation)",
        )
    )
    register(
        Backend(
            name="hf-ray",
            factory="rollgen_hf.fleet:HfRayGeneration",
            config_type=HfRayConfig,
            capabilities=CAPABILITIES | {Capability.DATA_PARALLEL, Capability.ADAPTERS},
            requires=("transformers", "ray"),
            install_hint="pip install 'rollgen[hf,ray]'",
            description="Hugging Face transformers engines as Ray actors: DP sharding, dead engines replaced",
        )
    )


@hookimpl
def rollgen_conformance_config(backend: str, base: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """hf-ray on CPU: a tenth of a CPU per engine's bundle, as the suite starts several."""
    if backend != "hf-ray":
        return None
    return {"hf_cfg": {"cpus_per_bundle": 0.1}}
