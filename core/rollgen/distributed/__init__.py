"""Ray orchestration shared by every backend: virtual clusters, tied worker groups, the
driver ↔ worker protocol."""

from rollgen.distributed.generation import RayGeneration
from rollgen.distributed.virtual_cluster import RayVirtualCluster, init_ray
from rollgen.distributed.worker import EngineWorker, GenerateRequest, WorkerSpec
from rollgen.distributed.worker_groups import RayWorkerBuilder, RayWorkerGroup, TiedGroup

__all__ = [
    "EngineWorker",
    "GenerateRequest",
    "RayGeneration",
    "RayVirtualCluster",
    "RayWorkerBuilder",
    "RayWorkerGroup",
    "TiedGroup",
    "WorkerSpec",
    "init_ray",
]
