"""Every hook a rollgen plugin can implement (pluggy project ``rollgen``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import pluggy

from rollgen.backend import Backend

PROJECT = "rollgen"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def rollgen_register_backends(register: Callable[[Backend], None]) -> None:
    """Register this plugin's backends by calling ``register(Backend(...))`` once per backend.

    Keep the plugin module light: name the factory by import path; do not import the engine.
    """


@hookspec
def rollgen_conformance_config(backend: str, base: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """Return config keys the conformance suite merges into ``base`` (the tiny-model config it
    builds for ``backend``), such as engine sub-dicts (``vllm_cfg``) sized for its test engines,
    or None to leave ``base`` unchanged.

    Called only on the plugin that registered ``backend`` (``backend`` tells apart the backends
    of a plugin that registers several). The suite alone uses it: ``rollgen generate`` and
    ``rollgen demo`` do not, so defaults that users need belong in the backend itself.
    """


@hookspec
def rollgen_conformance_known_failures(backend: str) -> Mapping[str, str] | None:
    """Return ``{test name: reason}`` for conformance tests known to fail on ``backend``.

    Called only on the plugin that registered ``backend``. A name is a test's name with or
    without its parameters (``test_reference_agreement[float32]``). They run as strict xfails: a
    known failure that starts passing fails the run, so the list stays true.
    """


@hookspec
def rollgen_register_tool_parsers(register: Callable[[str, Callable[[], Any]], None]) -> None:
    """Register tool-call parsers for ``rollgen serve`` by calling ``register(name, factory)``;
    ``factory()`` returns a ``rollgen.serving.ToolParser`` (``parse(text)`` → the text left and
    the tool calls found). The server picks one per model by name (its ``tool_parser`` setting).
    """
