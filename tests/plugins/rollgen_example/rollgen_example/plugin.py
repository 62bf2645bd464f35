"""Registers the ``example`` backend. Light: the engine module is imported only on creation."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from typing_extensions import NotRequired

from rollgen import Backend, Capability, GenerationConfig, hookimpl


class ExampleConfig(GenerationConfig):
    #: Recompute the whole sequence every step (this backend's only mode, kept as a real option).
    example_cfg: NotRequired[dict[str, Any]]


@hookimpl
def rollgen_register_backends(register: Callable[[Backend], None]) -> None:
    register(
        Backend(
            name="example",
            factory="rollgen_example.engine:ExampleGeneration",
            config_type=ExampleConfig,
            capabilities=frozenset({Capability.LOGPROBS, Capability.REFIT_TENSORS}),
            requires=("transformers",),
            install_hint="pip install ./tests/plugins/rollgen_example",
            description="example third-party backend: full recompute per token, no KV cache",
        )
    )


@hookimpl
def rollgen_conformance_config(backend: str, base: Mapping[str, Any]) -> Mapping[str, Any]:
    """The suite's engines set the example's own sub-dict (empty: its one mode)."""
    return {"example_cfg": {}}
