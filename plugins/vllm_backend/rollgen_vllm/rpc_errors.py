"""Typed errors across vLLM's engine-core RPC: a worker-extension method returns its
``RollgenError`` instead of raising it (vLLM wraps what its workers raise in an untyped exception),
and the driver's side raises it as itself."""

from __future__ import annotations

import functools
import pickle
from collections.abc import Callable
from typing import Any

from rollgen.errors import RollgenError

#: The key of the value a ``returns_errors`` method returns in place of raising.
RAISED = "rollgen_raised"


def returns_errors(method: Callable[..., Any]) -> Callable[..., Any]:
    """Make ``method`` (run in an engine's worker process) return its ``RollgenError``,
    pickled, as ``{RAISED: bytes}`` (engines wrap what their workers raise in an untyped
    exception, and vLLM's engine core serialises results with msgspec, which takes dicts of
    bytes); ``reraise`` on the caller's side raises it as itself."""

    @functools.wraps(method)
    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            return method(*args, **kwargs)
        except RollgenError as exc:
            return {RAISED: pickle.dumps(exc)}

    return call


def reraise(results: list[Any]) -> list[Any]:
    """``results`` of one call on every rank, raising the first rank's returned error."""
    for result in results:
        if isinstance(result, dict) and RAISED in result:
            raise pickle.loads(result[RAISED])
    return results
