"""``RayVirtualCluster``: one placement group per node, one bundle per GPU (or CPU slot)."""

from __future__ import annotations

import logging
import os
import uuid
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group

from rollgen.errors import ConfigError

logger = logging.getLogger(__name__)


def init_ray(num_cpus: int | None = None, object_store_bytes: int = 512 << 20) -> None:
    """Join the cluster in ``RAY_ADDRESS``, or start a small local one (no dashboard)."""
    if ray.is_initialized():
        return
    # the engines' logs reach the driver at their own level (``log_level`` of the engine config)
    kwargs: dict[str, Any] = {
        "include_dashboard": False,
        "log_to_driver": True,
        "logging_level": logging.WARNING,
    }
    if not os.environ.get("RAY_ADDRESS"):  # a cluster of its own, even beside another one on the machine
        kwargs.update(
            address="local", num_cpus=num_cpus or os.cpu_count(), object_store_memory=object_store_bytes
        )
    ray.init(**kwargs)


class RayVirtualCluster:
    """Reserves ``bundles_per_node[i]`` bundles on node i, as one placement group per node.

    GPU bundles hold ``gpus_per_bundle`` GPUs (1: a whole GPU; a fraction lets several small
    engines share one GPU) and ``cpus_per_bundle`` CPUs; CPU bundles hold ``cpus_per_bundle`` CPUs
    (fractions leave room for helper actors on small machines).
    """

    def __init__(
        self,
        bundles_per_node: list[int],
        use_gpus: bool,
        cpus_per_bundle: float = 1.0,
        name: str = "rollgen",
        gpus_per_bundle: float = 1.0,
        ready_timeout_s: float = 120.0,
    ) -> None:
        if not bundles_per_node or any(n < 1 for n in bundles_per_node):
            raise ConfigError(f"bundles_per_node must be positive counts, got {bundles_per_node}")
        if not 0 < gpus_per_bundle <= 1:
            raise ConfigError(f"gpus_per_bundle must be in (0, 1], got {gpus_per_bundle}")
        init_ray()
        self.bundles_per_node = list(bundles_per_node)
        self.use_gpus = use_gpus
        self.cpus_per_bundle = cpus_per_bundle
        self.gpus_per_bundle = gpus_per_bundle if use_gpus else 0.0
        bundle = {"GPU": gpus_per_bundle, "CPU": cpus_per_bundle} if use_gpus else {"CPU": cpus_per_bundle}
        self._pgs: list[PlacementGroup] = []
        self.name = f"{name}-{uuid.uuid4().hex[:8]}"
        for i, count in enumerate(bundles_per_node):
            pg = placement_group(
                [dict(bundle) for _ in range(count)], strategy="STRICT_PACK", name=f"{self.name}-node{i}"
            )
            self._pgs.append(pg)
        ready = [pg.ready() for pg in self._pgs]
        done, _ = ray.wait(ready, num_returns=len(ready), timeout=ready_timeout_s)
        if len(done) < len(ready):
            self.shutdown()
            raise ConfigError(
                f"Ray could not reserve {bundles_per_node} bundles of {bundle} within "
                f"{ready_timeout_s:.0f} s; the cluster has {ray.available_resources()}"
            )

    def get_placement_groups(self) -> list[PlacementGroup]:
        return list(self._pgs)

    def node_ids(self) -> list[str]:
        """The Ray node id each placement group landed on."""
        table = ray.util.placement_group_table()
        return [table[pg.id.hex()]["bundles_to_node_id"][0] for pg in self._pgs]

    def shutdown(self) -> None:
        for pg in self._pgs:
            try:
                remove_placement_group(pg)
            except ValueError:  # already removed
                logger.debug("placement group %s already removed", pg.id)
        self._pgs = []
