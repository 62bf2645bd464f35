"""``VllmGeneration``: the trainer-facing side of the vLLM backend."""

from __future__ import annotations

import logging
import pickle
from collections.abc import Mapping
from typing import Any

import ray
from rollgen.data import BatchedDataDict
from rollgen.distributed import RayVirtualCluster, RayWorkerBuilder, RayWorkerGroup, init_ray
from rollgen.errors import ConfigError
from rollgen.interface import BaseGeneration
from rollgen.refit import WeightBucket, dtype_name

from rollgen_vllm.config import VLLM_CFG_DEFAULTS

logger = logging.getLogger(__name__)


class VllmGeneration(BaseGeneration):
    """Data parallelism = number of tied groups; batches are sharded across their leaders
    (uneven shards allowed) and merged back in order. Logprobs are vLLM's raw logprobs."""

    def __init__(
        self, config: Mapping[str, Any], cluster: RayVirtualCluster | None = None, backend: Any = None
    ) -> None:
        super().__init__(config, cluster=cluster, backend=backend)
        vcfg = {**VLLM_CFG_DEFAULTS, **(self.cfg.get("vllm_cfg") or {})}
        init_ray()
        self.use_gpus = ray.cluster_resources().get("GPU", 0) > 0
        if vcfg["enable_sleep_mode"] == "auto":
            vcfg["enable_sleep_mode"] = self.use_gpus
        elif vcfg["enable_sleep_mode"] and not self.use_gpus:
            raise ConfigError("vllm_cfg.enable_sleep_mode: vLLM has no sleep mode on CPU; leave it 'auto'")
        tp = vcfg["tensor_parallel_size"]
        self.cfg.update(
            vllm_cfg=vcfg, _engine_dtype=dtype_name(self.engine_dtype), _max_model_len=self.max_model_len
        )
        self._own_cluster = cluster is None
        if cluster is None:
            cpus = 1.0 if self.use_gpus else vcfg["cpus_per_bundle"]
            cluster = RayVirtualCluster(
                [tp * vcfg["data_parallel_size"]], self.use_gpus, cpus, name="rollgen-vllm"
            )
        self.cluster = cluster
        if self.use_gpus:
            leader = {"num_gpus": 0.5 if tp == 1 else 0, "num_cpus": cluster.cpus_per_bundle / 2}
        else:
            leader = {"num_cpus": cluster.cpus_per_bundle}
        self.local_transport = "cuda_ipc" if self.use_gpus else "shared_memory"
        try:
            self.group = RayWorkerGroup(
                cluster,
                RayWorkerBuilder("rollgen_vllm.worker:VllmWorker", self.cfg, self.use_gpus),
                tp,
                name_prefix="rollgen-vllm",
                leader_resources=leader,
            )
            self.engine_info = self.group.call_all("ready")
        except BaseException:
            self._release()
            raise
        logger.info("vllm backend up: dp=%d tp=%d %s", self.group.dp_size, tp, self.engine_info[0])

    @property
    def dp_size(self) -> int:
        return self.group.dp_size

    @property
    def releases_memory_on_sleep(self) -> bool:
        return bool(self.cfg["vllm_cfg"]["enable_sleep_mode"])

    def _generate(self, batch: BatchedDataDict[Any], greedy: bool) -> BatchedDataDict[Any]:
        batch["_params"] = self.sample_params(batch, greedy)
        shards = batch.shard_by_batch_size(self.dp_size, allow_uneven_shards=True)
        results = self.group.call_sharded("generate", shards)
        return BatchedDataDict.from_batches(results, pad_value_dict={"output_ids": self.cfg["pad_token_id"]})

    def _apply_bucket(self, bucket: WeightBucket) -> None:
        # one pickle per leader: shared-memory handles are made per receiver
        self.group.call_sharded("apply_bucket", [pickle.dumps(bucket) for _ in range(self.dp_size)])

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
        if self._own_cluster and self.cluster is not None:
            self.cluster.shutdown()
