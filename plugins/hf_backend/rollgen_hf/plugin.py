"""Entry point of the ``hf`` backend: registers it without importing transformers."""

from __future__ import annotations

from collections.abc import Callable

from rollgen import Backend, Capability, hookimpl
from rollgen_hf.config import HfConfig

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
            capabilities=CAPABILITIES,
            requires=("transformers",),
            install_hint="pip install 'rollgen[hf]'",
            description="Hugging Face transformers, in process (reference implementation)",
        )
    )
