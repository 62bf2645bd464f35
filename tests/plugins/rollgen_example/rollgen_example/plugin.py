"""Registers the ``example`` backend. Light: the engine module is imported only on creation."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from pydantic import ConfigDict
from typing_extensions import NotRequired, TypedDict

from rollgen import Backend, Capability, GenerationConfig, hookimpl
from rollgen.spec import EngineSubDict


class ExampleCfg(TypedDict):
    """The example engine's own keys: none (its one mode recomputes the whole sequence every
    step); typed all the same, so that a key given here is a ConfigError, not ignored."""

    __pydantic_config__ = ConfigDict(extra="forbid", strict=True)  # type: ignore[misc]


class ExampleConfig(GenerationConfig):
    example_cfg: NotRequired[EngineSubDict[ExampleCfg]]


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
