"""Ray orchestration shared by every backend: virtual clusters, tied worker groups."""

from rollgen.distributed.generation import RayGeneration
from rollgen.distributed.virtual_cluster import RayVirtualCluster, init_ray
from rollgen.distributed.worker_groups import RayWorkerBuilder, RayWorkerGroup, TiedGroup

__all__ = [
    "RayGeneration",
    "RayVirtualCluster",
    "RayWorkerBuilder",
    "RayWorkerGroup",
    "TiedGroup",
    "init_ray",
]
