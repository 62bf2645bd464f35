"""Registers the ``remote`` backend (a client of ``rollgen serve``), and gives the conformance
suite a server to test it against."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from rollgen import Backend, Capability, hookimpl
from rollgen_remote.config import RemoteConfig

#: What a client of the endpoint can do: no refit and no sleep (the trainer beside the server
#: does those), the rest as the server's backend does it (checked when the client starts).
CAPABILITIES = frozenset(
    {
        Capability.TEXT,
        Capability.LOGPROBS,
        Capability.STOP_STRINGS,
        Capability.PER_SAMPLE_SAMPLING,
        Capability.ASYNC,
    }
)


@hookimpl
def rollgen_register_backends(register: Callable[[Backend], None]) -> None:
    register(
        Backend(
            name="remote",
            factory="rollgen_remote.generation:RemoteGeneration",
            config_type=RemoteConfig,
            capabilities=CAPABILITIES,
            requires=("httpx",),
            install_hint="pip install 'rollgen[serve]'",
            description="a client of a rollgen serve endpoint, over HTTP",
        )
    )


@hookimpl
def rollgen_conformance_config(backend: str, base: Mapping[str, Any]) -> Mapping[str, Any]:
    """The server the suite's clients reach: ``ROLLGEN_REMOTE_URL`` (and ``ROLLGEN_API_KEY``)
    where set, else a ``rollgen serve`` this process starts over ``ROLLGEN_REMOTE_BACKEND``
    (default ``hf``) on the suite's model, stopped when the process ends."""
    from rollgen_remote.conformance import suite_server

    url, key = suite_server(base)
    return {"remote_cfg": {"url": url, "api_key": key}}


@hookimpl
def rollgen_conformance_known_failures(backend: str) -> Mapping[str, str]:
    from rollgen_remote.conformance import KNOWN_FAILURES

    return KNOWN_FAILURES
