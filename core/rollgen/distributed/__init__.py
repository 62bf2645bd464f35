"""Ray orchestration shared by every backend: virtual clusters, tied worker groups, the
driver ↔ worker protocol. Its names import Ray when first used, not with the package: a plugin's
config type subclasses ``rollgen.distributed.config.RayEngineCfg`` at discovery, without Ray."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rollgen.distributed.config import RayEngineCfg
    from rollgen.distributed.generation import RayGeneration
    from rollgen.distributed.virtual_cluster import RayVirtualCluster, init_ray
    from rollgen.distributed.worker import EngineWorker, GenerateRequest, WorkerSpec
    from rollgen.distributed.worker_groups import RayWorkerBuilder, RayWorkerGroup, TiedGroup

#: Each public name and the module that defines it.
_HOMES = {
    "RayEngineCfg": "config",
    "RayGeneration": "generation",
    "RayVirtualCluster": "virtual_cluster",
    "init_ray": "virtual_cluster",
    "EngineWorker": "worker",
    "GenerateRequest": "worker",
    "WorkerSpec": "worker",
    "RayWorkerBuilder": "worker_groups",
    "RayWorkerGroup": "worker_groups",
    "TiedGroup": "worker_groups",
}

__all__ = [
    "EngineWorker",
    "GenerateRequest",
    "RayEngineCfg",
    "RayGeneration",
    "RayVirtualCluster",
    "RayWorkerBuilder",
    "RayWorkerGroup",
    "TiedGroup",
    "WorkerSpec",
    "init_ray",
]


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
