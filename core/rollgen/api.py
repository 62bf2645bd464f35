"""``create_generation``: config string → a backend's GenerationInterface."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rollgen.config import validate_config
from rollgen.errors import ConfigError
from rollgen.interface import GenerationInterface
from rollgen.registry import get_registry


def create_generation(config: Mapping[str, Any], cluster: Any = None) -> GenerationInterface:
    """Validate ``config`` and build the backend named by ``config["backend"]``.

    Raises BackendNotFound, BackendUnavailable or ConfigError before any engine starts.
    ``cluster`` is a ``rollgen.distributed.RayVirtualCluster`` for backends that use Ray.
    """
    if not isinstance(config, Mapping):
        raise ConfigError(f"config must be a mapping, got {type(config).__name__}")
    name = config.get("backend")
    registry = get_registry()
    if not isinstance(name, str):
        raise ConfigError(
            "config needs a 'backend' string naming the engine; installed: "
            + ", ".join(sorted(registry.backends))
        )
    entry = registry.get(name)
    cfg = validate_config(config, entry.backend.config_type)
    factory = entry.load_factory()
    return factory(cfg, cluster=cluster, backend=entry.backend)
