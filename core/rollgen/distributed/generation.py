"""``RayGeneration``: the driver side shared by every backend whose engines live in Ray actors,
one per tied group (vLLM, SGLang). A backend names its worker class and its config sub-dict."""

from __future__ import annotations

import logging
import pickle
from collections.abc import Mapping
from contextlib import ExitStack
from typing import Any, ClassVar

import ray

from rollgen.data import BatchedDataDict
from rollgen.distributed.virtual_cluster import RayVirtualCluster, init_ray
from rollgen.distributed.worker_groups import RayWorkerBuilder, RayWorkerGroup
from rollgen.errors import ConfigError
from rollgen.interface import BaseGeneration
from rollgen.refit import WeightBucket, dtype_name

logger = logging.getLogger(__name__)

#: Keys every Ray-actor backend's engine sub-dict has, with their defaults.
RAY_ENGINE_DEFAULTS: dict[str, Any] = {
    "tensor_parallel_size": 1,
    "data_parallel_size": 1,
    "enable_sleep_mode": "auto",
    "cpus_per_bundle": 0.5,
    "gpus_per_bundle": 1.0,
}


def leader_resources(cluster: RayVirtualCluster, tp: int, use_gpus: bool) -> dict[str, float]:
    """The Ray resources of a tied group's leader actor, taken from its first bundle: on GPU
    half the bundle (TP > 1: no GPU, the engine's own workers take the group's GPUs), on CPU
    the bundle's CPUs."""
    if not use_gpus:
        return {"num_cpus": cluster.cpus_per_bundle}
    return {
        "num_gpus": cluster.gpus_per_bundle / 2 if tp == 1 else 0,
        "num_cpus": cluster.cpus_per_bundle / 2,
    }


class RayGeneration(BaseGeneration):
    """Data parallelism = number of tied groups; a batch is sharded across their leaders (uneven
    shards allowed, empty ones not sent) and merged back in order.

    The worker class (``worker_cls``, "module:Class") is built as ``Worker(cfg, use_gpus, group,
    index)`` and implements ``ready``, ``generate(shard)``, ``apply_bucket(bytes)``,
    ``reset_prefix_cache``, ``sleep``, ``wake(tags)`` and ``shutdown``.
    """

    worker_cls: ClassVar[str]
    engine_key: ClassVar[str]
    engine_defaults: ClassVar[dict[str, Any]] = {}
    #: Tokens of the engine's context it will not take as prompt: rollgen's ``max_model_len``
    #: (validation, clamping) is that much shorter than the context length the engine gets.
    reserved_context: ClassVar[int] = 0

    def __init__(
        self, config: Mapping[str, Any], cluster: RayVirtualCluster | None = None, backend: Any = None
    ) -> None:
        super().__init__(config, cluster=cluster, backend=backend)
        ecfg = {**RAY_ENGINE_DEFAULTS, **self.engine_defaults, **(self.cfg.get(self.engine_key) or {})}
        init_ray()
        self.use_gpus = ray.cluster_resources().get("GPU", 0) > 0
        if ecfg["enable_sleep_mode"] == "auto":
            ecfg["enable_sleep_mode"] = self.use_gpus
        elif ecfg["enable_sleep_mode"] and not self.use_gpus:
            raise ConfigError(f"{self.engine_key}.enable_sleep_mode needs CUDA; leave it 'auto' on CPU")
        tp = ecfg["tensor_parallel_size"]
        if tp > 1 and ecfg["gpus_per_bundle"] < 1:
            raise ConfigError(
                f"{self.engine_key}.gpus_per_bundle={ecfg['gpus_per_bundle']} with "
                f"tensor_parallel_size={tp}: a tensor-parallel group needs a whole GPU per rank; "
                "leave gpus_per_bundle at 1"
            )
        self.cfg.update(
            {self.engine_key: ecfg},
            _engine_dtype=dtype_name(self.engine_dtype),
            _max_model_len=self.max_model_len,
        )
        self.max_model_len -= self.reserved_context
        self._own_cluster = cluster is None
        if cluster is None:
            cpus = 1.0 if self.use_gpus else ecfg["cpus_per_bundle"]
            cluster = RayVirtualCluster(
                [tp * ecfg["data_parallel_size"]],
                self.use_gpus,
                cpus,
                name=f"rollgen-{self.name}",
                gpus_per_bundle=ecfg["gpus_per_bundle"],
            )
        self.cluster = cluster
        self.local_transport = "cuda_ipc" if self.use_gpus else "shared_memory"
        with ExitStack() as on_failure:  # a failed start frees what it reserved
            on_failure.callback(self._release)
            self.group = RayWorkerGroup(
                cluster,
                RayWorkerBuilder(self.worker_cls, self.cfg, self.use_gpus),
                tp,
                name_prefix=f"rollgen-{self.name}",
                leader_resources=leader_resources(cluster, tp, self.use_gpus),
            )
            self.engine_info = self.group.call_all("ready")
            on_failure.pop_all()
        logger.info("%s up: dp=%d tp=%d %s", self.name, self.group.dp_size, tp, self.engine_info[0])

    @property
    def engine_cfg(self) -> dict[str, Any]:
        return self.cfg[self.engine_key]

    @property
    def dp_size(self) -> int:
        return self.group.dp_size

    @property
    def releases_memory_on_sleep(self) -> bool:
        return bool(self.engine_cfg["enable_sleep_mode"])

    def _generate(self, batch: BatchedDataDict[Any], greedy: bool) -> BatchedDataDict[Any]:
        batch["_params"] = self.sample_params(batch, greedy)
        shards = batch.shard_by_batch_size(self.dp_size, allow_uneven_shards=True)
        results = self.group.call_sharded("generate", shards)
        return BatchedDataDict.from_batches(results, pad_value_dict={"output_ids": self.cfg["pad_token_id"]})

    def _apply_bucket(self, bucket: WeightBucket) -> list[Any]:
        """Each leader's report of the bucket (one pickle per leader: shared-memory handles are
        made per receiver)."""
        return self.group.call_sharded("apply_bucket", [pickle.dumps(bucket) for _ in range(self.dp_size)])

    def _reset_prefix_cache(self) -> None:
        self.group.call_all("reset_prefix_cache")

    def _sleep(self) -> None:
        self.group.call_all("sleep")

    def _wake(self, tags: list[str]) -> None:
        self.group.call_all("wake", tags)

    def _shutdown(self) -> None:
        self._release()

    def _release(self) -> None:
        group = getattr(self, "group", None)
        if group is not None:
            group.shutdown()
        if self._own_cluster and getattr(self, "cluster", None) is not None:
            self.cluster.shutdown()
