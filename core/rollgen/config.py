"""Config validation: one pydantic pass over the backend's TypedDict, every problem reported."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from functools import cache
from typing import Any

from pydantic import TypeAdapter, ValidationError

from rollgen.errors import ConfigError


@cache
def _adapter(config_type: type) -> TypeAdapter[Any]:
    return TypeAdapter(config_type)


def _describe(err: Mapping[str, Any]) -> str:
    where = ".".join(str(p) for p in err["loc"]) or "<config>"
    if err["type"] == "missing":
        return f"{where}: required key is missing"
    if err["type"] == "extra_forbidden":
        return f"{where}: unknown key (check the spelling; engine options go in <engine>_kwargs)"
    return f"{where}: {err['msg']} (got {err.get('input')!r})"


def validate_config(config: Mapping[str, Any], config_type: type) -> dict[str, Any]:
    """Validate ``config`` against ``config_type``; the result has every default filled in.

    Raises ConfigError listing every problem at once.
    """
    if not isinstance(config, Mapping):
        raise ConfigError(f"config must be a mapping, got {type(config).__name__}")
    try:
        validated = _adapter(config_type).validate_python(dict(config))
    except ValidationError as exc:
        problems = [_describe(e) for e in exc.errors()]
        raise ConfigError(
            f"invalid config for backend {config.get('backend')!r}: {len(problems)} problem(s)",
            problems,
        ) from None
    return dict(validated)


def deep_merge(base: Mapping[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` with ``extra`` merged in, nested mappings key by key (neither is modified)."""
    out = copy.deepcopy(dict(base))
    for k, v in extra.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, Mapping) and isinstance(out.get(k), Mapping) else v
    return out
