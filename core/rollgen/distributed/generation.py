"""``RayGeneration``: the driver side shared by every backend whose engines live in Ray actors,
one per tied group (vLLM, SGLang). A backend names its worker class and its config sub-dict.

The engines' options are computed first, without Ray (``plan_engines``, unit-tested); the
start-up then reserves the bundles and starts one ``EngineWorker`` per tied group. Their owner,
``Replicas``, is built first; the refit link, the dispatcher and the replacement policy
(``Fleet``) are each handed it, in that order (calls go policy → link → replicas)."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any, ClassVar

import ray
import torch

from rollgen.base import BaseGeneration, serialised
from rollgen.data import BatchedDataDict
from rollgen.distributed.dispatch import SampleDispatcher
from rollgen.distributed.fleet import Fleet
from rollgen.distributed.refit_link import RayLink
from rollgen.distributed.replicas import Replicas, ReplicaStatus
from rollgen.distributed.virtual_cluster import RayVirtualCluster, init_ray
from rollgen.distributed.worker import EngineWorker, WorkerSpec
from rollgen.distributed.worker_groups import RayWorkerBuilder, RayWorkerGroup, TiedGroup
from rollgen.errors import ConfigError, WorkerError
from rollgen.refit import Transport, dtype_name
from rollgen.rollout import ReplicaLoad, SampleRequest
from rollgen.sampling import SampleParams
from rollgen.wake import WAKE_TAGS

logger = logging.getLogger(__name__)

#: Seconds ``shutdown`` waits for a call in progress, and then for the engines' own cleanup,
#: before it kills what has not answered.
SHUTDOWN_WAIT_S = 60.0


@dataclass(frozen=True)
class EnginePlan:
    """What to start: the worker spec every engine shares (its tied group and index are set per
    worker), the bundles to reserve when no cluster is given, and the context rollgen checks
    prompts against."""

    spec: WorkerSpec
    #: Prompt plus generation the backend takes (the engine's context, less what it reserves).
    max_model_len: int
    data_parallel_size: int
    cpus_per_bundle: float
    gpus_per_bundle: float

    def worker_spec(self, group: TiedGroup, index: int) -> WorkerSpec:
        return dataclasses.replace(self.spec, group=group, index=index)


def plan_engines(
    cfg: Mapping[str, Any],
    engine_key: str,
    *,
    use_gpus: bool,
    engine_dtype: str,
    context_length: int,
    reserved_context: int = 0,
) -> EnginePlan:
    """The engines' options for a validated config (``cfg[engine_key]`` has every default), on
    a machine with or without GPUs. ConfigError for settings that cannot work there."""
    engine = dict(cfg[engine_key])
    if engine["enable_sleep_mode"] == "auto":
        engine["enable_sleep_mode"] = use_gpus
    elif engine["enable_sleep_mode"] and not use_gpus:
        raise ConfigError(f"{engine_key}.enable_sleep_mode needs CUDA; leave it 'auto' on CPU")
    tp = engine["tensor_parallel_size"]
    if tp > 1 and engine["gpus_per_bundle"] < 1:
        raise ConfigError(
            f"{engine_key}.gpus_per_bundle={engine['gpus_per_bundle']} with tensor_parallel_size={tp}: "
            "a tensor-parallel group needs a whole GPU per rank; leave gpus_per_bundle at 1"
        )
    spec = WorkerSpec(
        model_name=cfg["model_name"],
        dtype=engine_dtype,
        context_length=context_length,
        seed=cfg["seed"],
        logprobs_mode=cfg["logprobs_mode"],
        pad_token_id=cfg["pad_token_id"],
        engine=engine,
        engine_kwargs=dict(cfg.get(engine_key.replace("_cfg", "_kwargs")) or {}),
        lora=cfg.get("lora"),
        use_gpus=use_gpus,
        group=TiedGroup(0, tuple(range(tp))),
        index=0,
    )
    return EnginePlan(
        spec=spec,
        max_model_len=context_length - reserved_context,
        data_parallel_size=engine["data_parallel_size"],
        cpus_per_bundle=1.0 if use_gpus else engine["cpus_per_bundle"],
        gpus_per_bundle=engine["gpus_per_bundle"],
    )


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
    shards allowed, empty ones not sent) and merged back in order. The worker class
    (``worker_cls``, "module:Class") is an ``EngineWorker``, built as ``Worker(spec)``."""

    worker_cls: ClassVar[str]
    engine_key: ClassVar[str]
    #: Tokens of the engine's context it will not take as prompt: rollgen's ``max_model_len``
    #: (validation, clamping) is that much shorter than the context length the engine gets.
    reserved_context: ClassVar[int] = 0
    #: The ranks each engine joins a weight-sync group with (None: one per tensor-parallel rank).
    sync_ranks_per_engine: ClassVar[int | None] = None
    shutdown_wait_s: ClassVar[float | None] = SHUTDOWN_WAIT_S

    def __init__(
        self, config: Mapping[str, Any], cluster: RayVirtualCluster | None = None, backend: Any = None
    ) -> None:
        super().__init__(config, cluster=cluster, backend=backend)
        init_ray()
        self.use_gpus = ray.cluster_resources().get("GPU", 0) > 0
        self.plan = self.make_plan(self.use_gpus)
        self.max_model_len = self.plan.max_model_len
        #: How refits reach the engines (``RayLink.facts``).
        self.transport: Transport = "cuda_ipc" if self.use_gpus else "shared_memory"
        self._own_cluster = cluster is None
        tp = self.plan.spec.tensor_parallel_size
        if cluster is None:
            cluster = RayVirtualCluster(
                [tp * self.plan.data_parallel_size],
                self.use_gpus,
                self.plan.cpus_per_bundle,
                name=f"rollgen-{self.name}",
                gpus_per_bundle=self.plan.gpus_per_bundle,
            )
        self.cluster = cluster
        engine, wait_s = self.plan.spec.engine, self.shutdown_wait_s or SHUTDOWN_WAIT_S
        with ExitStack() as on_failure:  # a failed start frees what it reserved, in reverse
            on_failure.callback(self._free_cluster)
            group = RayWorkerGroup(
                cluster,
                RayWorkerBuilder(self.worker_cls, lambda group, i: (self.plan.worker_spec(group, i),)),
                tp,
                name_prefix=f"rollgen-{self.name}",
                leader_resources=leader_resources(cluster, tp, self.use_gpus),
                one_at_a_time=0 < cluster.gpus_per_bundle < 1,  # engines that may share a GPU
                cleanup=EngineWorker.shutdown,
            )
            on_failure.callback(group.shutdown, EngineWorker.shutdown, wait_s)
            self.engines = engines = Replicas(group, self.name, engine["engine_failures"] == "replace")
            on_failure.callback(engines.shutdown, EngineWorker.shutdown, wait_s)
            ranks = self.sync_ranks_per_engine or tp
            sync_device = torch.device("cuda" if self.use_gpus else "cpu")
            self._link = RayLink(engines, self.name, self.transport, sync_device, ranks, self.refits_in_place)
            on_failure.callback(self._link.close)
            self._dispatcher = SampleDispatcher(
                engines, self._streams.deliver, self._worker_failed, self._streams.progress
            )
            on_failure.callback(self._dispatcher.close)
            self.fleet = Fleet(engines, self._link, engine, self.transport, lambda: self.weight_version)
            self.link_engine(self._link)
            self.updates.on_update(self.fleet.updated)  # the fleet keeps what a replacement needs
            group.call_timeout_s = engine["call_timeout_s"]
            on_failure.pop_all()
        logger.info("%s up: dp=%d tp=%d %s", self.name, self.dp_size, tp, engines.info(0))

    def make_plan(self, use_gpus: bool) -> EnginePlan:
        """The engines' options on this machine."""
        engine = self.machine_defaults(self.cfg[self.engine_key], use_gpus)
        return plan_engines(
            {**self.cfg, self.engine_key: engine},
            self.engine_key,
            use_gpus=use_gpus,
            engine_dtype=dtype_name(self.engine_dtype),
            context_length=self.max_model_len,
            reserved_context=self.reserved_context,
        )

    def machine_defaults(self, engine: dict[str, Any], use_gpus: bool) -> dict[str, Any]:
        """The engine sub-dict with its machine-dependent defaults resolved (backends override)."""
        return dict(engine)

    @property
    def reads_weights(self) -> bool:
        return self.cfg[self.engine_key].get("load_format") != "dummy"

    @property
    def worker_specs(self) -> list[WorkerSpec]:
        """The spec each engine worker was started with, in data-parallel order."""
        return [self.plan.worker_spec(g, i) for i, g in enumerate(self.engines.group.groups)]

    @property
    def refits_in_place(self) -> bool:
        """Whether a colocated trainer's refit of the tensors it refitted last has the engines
        read them in place (``rollgen.refit.in_place``), where the staging buffers serve."""
        return False

    @property
    def dp_size(self) -> int:
        return len(self.engines)

    @property
    def releases_memory_on_sleep(self) -> bool:
        return self.plan.spec.sleep_enabled

    def _generate(self, batch: BatchedDataDict[Any], params: list[SampleParams]) -> BatchedDataDict[Any]:
        self.fleet.admit()
        results = self.engines.shard(batch, params)
        return BatchedDataDict.from_batches(results, pad_value_dict={"output_ids": self.cfg["pad_token_id"]})

    def _stream_start(self, requests: list[SampleRequest]) -> None:
        self.fleet.admit()
        self._dispatcher.start(requests)

    # ---- replicas (rollgen.distributed.replicas, .fleet) ------------------------------------------
    @property
    def replicas(self) -> list[ReplicaStatus]:
        """Each replica's state (starting, stale, healthy, dead), weight version, samples in
        flight, restarts and last error."""
        return self.engines.status([r.running for r in self._dispatcher.load()])

    @serialised
    def restore_replicas(self, timeout_s: float | None = None) -> list[ReplicaStatus]:
        """Wait up to ``timeout_s`` (None: no limit) for the replacements starting, bring those
        that started to the current weights and put them in service (``generate`` and
        ``submit`` do this without waiting); returns ``replicas``."""
        self._check_open()
        self._awake.require(WAKE_TAGS, "restore replicas")
        self.fleet.admit(timeout_s)
        return self.replicas

    def _worker_failed(self, error: WorkerError) -> None:
        if not (error.died and self.engines.died_as(error)):  # with "replace", a death others survive
            super()._worker_failed(error)

    def _stream_abort(self, keys: list[str]) -> None:
        self._dispatcher.abort(keys)

    def replica_load(self) -> list[ReplicaLoad]:
        return self._dispatcher.load()

    def _sleep(self) -> None:
        self.engines.call(EngineWorker.sleep)

    def _wake(self, tags: list[str]) -> None:
        self.engines.call(EngineWorker.wake, tags)

    def _shutdown(self) -> None:
        try:
            self.updates.release()
        except WorkerError as exc:  # a dead or hung worker: what it mapped goes with its process
            logger.warning("%s: the engines could not release the refit buffers: %s", self.name, exc)
        finally:
            self.updates.close()
            self._dispatcher.close()
            self.engines.shutdown(EngineWorker.shutdown, self.shutdown_wait_s or SHUTDOWN_WAIT_S)
            self._free_cluster()

    def _free_cluster(self) -> None:
        if self._own_cluster:
            self.cluster.shutdown()
