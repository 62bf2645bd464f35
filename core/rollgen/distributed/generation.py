"""``RayGeneration``: the driver side shared by every backend whose engines live in Ray actors,
one per tied group (vLLM, SGLang). A backend names its worker class and its config sub-dict.

The engines' options are computed first, without Ray (``plan_engines``, unit-tested); the
start-up then reserves the bundles and starts one ``EngineWorker`` per tied group."""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import time
from collections.abc import Callable, Mapping
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any, ClassVar

import ray
import torch

from rollgen.base import BaseGeneration, Packing, serialised
from rollgen.data import BatchedDataDict
from rollgen.distributed import channel
from rollgen.distributed.channel import Channel
from rollgen.distributed.dispatch import SampleDispatcher
from rollgen.distributed.virtual_cluster import RayVirtualCluster, init_ray
from rollgen.distributed.worker import EngineWorker, GenerateRequest, WorkerSpec, running
from rollgen.distributed.worker_groups import RayWorkerBuilder, RayWorkerGroup, TiedGroup
from rollgen.errors import ConfigError, RollgenError, WorkerError
from rollgen.in_place import InPlaceSources
from rollgen.refit import KEPT_UNPACKED, WeightBucket, WeightSpec, dtype_name
from rollgen.rollout import SampleRequest
from rollgen.staging import RefitStaging, flat_sizes
from rollgen.weight_sync import SyncGroupSpec

logger = logging.getLogger(__name__)

#: Seconds the driver waits for engines to let go of staging buffers (on release, or after a
#: bucket failed on one engine while others still read it).
STAGED_WAIT_S = 60.0
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


def wait_for_exit(pids: list[int], timeout_s: float = 30.0) -> None:
    """Return once the processes ``pids`` (of this machine) have exited (Ray ends a killed
    actor's process shortly after it reports the actor dead); log those that outlive
    ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if running(p)]
        if alive:
            time.sleep(0.05)
    if alive:
        logger.warning("engine worker processes %s still run %.0f s after shutdown", alive, timeout_s)


class RayGeneration(BaseGeneration):
    """Data parallelism = number of tied groups; a batch is sharded across their leaders (uneven
    shards allowed, empty ones not sent) and merged back in order. The worker class
    (``worker_cls``, "module:Class") is an ``EngineWorker``, built as ``Worker(spec)``."""

    worker_cls: ClassVar[str]
    engine_key: ClassVar[str]
    #: Tokens of the engine's context it will not take as prompt: rollgen's ``max_model_len``
    #: (validation, clamping) is that much shorter than the context length the engine gets.
    reserved_context: ClassVar[int] = 0
    engines_in_process: ClassVar[bool] = False
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
        self.local_transport = "cuda_ipc" if self.use_gpus else "shared_memory"
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
        with ExitStack() as on_failure:  # a failed start frees what it reserved
            on_failure.callback(self._release)
            self.group = RayWorkerGroup(
                cluster,
                RayWorkerBuilder(self.worker_cls, lambda group, i: (self.plan.worker_spec(group, i),)),
                tp,
                name_prefix=f"rollgen-{self.name}",
                leader_resources=leader_resources(cluster, tp, self.use_gpus),
                one_at_a_time=0 < cluster.gpus_per_bundle < 1,  # engines that may share a GPU
                cleanup=EngineWorker.shutdown,
            )
            self.engine_info = self.group.call_all(EngineWorker.ready)
            self._dispatcher = SampleDispatcher(
                self.group, [info["capacity"] for info in self.engine_info], self._streams.deliver
            )
            #: Each engine rank's refit channel (none where the engines have none, or they do
            #: not connect), and the kept layouts each engine loaded over them (sent by name
            #: alone from then on).
            self._channels = self._open_channels()
            self._held: list[dict[str, None]] = [{} for _ in range(self.dp_size)]
            self.group.call_timeout_s = self.plan.spec.engine["call_timeout_s"]
            on_failure.pop_all()
        #: Where ``refit`` packs over CUDA IPC, when every worker reports its GPUs; and its
        #: refits in place, where the backend has them.
        self._staging = (
            RefitStaging()
            if self.local_transport == "cuda_ipc" and all(info["devices"] for info in self.engine_info)
            else None
        )
        self._in_place = InPlaceSources() if self._staging is not None and self.refits_in_place else None
        logger.info("%s up: dp=%d tp=%d %s", self.name, self.dp_size, tp, self.engine_info[0])

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
        return [self.plan.worker_spec(g, i) for i, g in enumerate(self.group.groups)]

    @property
    def refits_in_place(self) -> bool:
        """Whether a colocated trainer's refit of the tensors it refitted last has the engines
        read them in place (``rollgen.in_place``), where the staging buffers serve."""
        return False

    @property
    def dp_size(self) -> int:
        return self.group.dp_size

    @property
    def releases_memory_on_sleep(self) -> bool:
        return self.plan.spec.sleep_enabled

    def _generate(self, batch: BatchedDataDict[Any], greedy: bool) -> BatchedDataDict[Any]:
        requests = GenerateRequest.shards(batch, self.sample_params(batch, greedy), self.dp_size)
        results = self.group.call_sharded(EngineWorker.generate, requests)
        return BatchedDataDict.from_batches(results, pad_value_dict={"output_ids": self.cfg["pad_token_id"]})

    def _stream_start(self, requests: list[SampleRequest]) -> None:
        self._dispatcher.start(requests)

    def _stream_abort(self, keys: list[str]) -> None:
        self._dispatcher.abort(keys)

    def _apply_bucket(self, bucket: WeightBucket) -> None:
        self._send_bucket(bucket, reset_prefix=False)

    def _apply_last_bucket(self, bucket: WeightBucket) -> None:
        self._send_bucket(bucket, reset_prefix=True)

    def _send_bucket(self, bucket: WeightBucket, reset_prefix: bool) -> None:
        if self._channels:
            self._send_over_channels(bucket, self._channels)
            if reset_prefix:
                self._reset_prefix_cache()
            return
        # one pickle per leader: shared-memory handles are made per receiver, and a kept layout's
        # bucket carries the leader's own exports; the prefix reset in the same call
        args = [
            (bucket.layout, self._pickled(bucket, i), bucket.transport, reset_prefix)
            for i in range(self.dp_size)
        ]
        refs = self.group.submit(EngineWorker.apply_bucket, args)
        try:
            self.group.get(refs)
        finally:
            if bucket.layout:  # after a failure, the next refit writes what others may still read
                ray.wait(refs, num_returns=len(refs), timeout=STAGED_WAIT_S)

    def _send_over_channels(self, bucket: WeightBucket, channels: list[list[Channel]]) -> None:
        """Every engine rank loads ``bucket`` over its refit channel: a kept layout its engine
        holds by name alone, else with its pickle (one per rank: shared-memory handles open once
        per receiver), which a rank that no longer holds the layout gets next. Every rank
        answers before an error is raised (no rank still reads what the next refit writes), an
        engine's death first; a failure that leaves answers unread closes the channels (later
        refits go through the actors)."""
        layout, errors = bucket.layout, []
        ranks = [(i, rank) for i, engine in enumerate(channels) for rank in engine]

        def exchange(
            requests: list[tuple[int, Channel, tuple[str, bytes | None]]],
        ) -> list[tuple[int, Channel]]:
            sent, missed = [], []
            try:
                try:
                    for i, rank, request in requests:
                        rank.send(request)
                        sent.append((i, rank))
                except RollgenError as exc:  # a closed channel: the ranks sent to still answer
                    errors.append(exc)
                for i, rank in sent:
                    try:
                        if not rank.result():
                            missed.append((i, rank))
                    except RollgenError as exc:
                        errors.append(exc)
            except BaseException:  # answers left unread: these channels are out of step
                channel.close(channels)
                self._channels = []
                raise
            return missed

        requests = [
            (i, rank, (layout, None if layout in self._held[i] else self._pickled(bucket, i)))
            for i, rank in ranks
        ]
        missed = exchange(requests)
        if missed:  # ranks keep the last KEPT_UNPACKED layouts
            exchange([(i, rank, (layout, self._pickled(bucket, i))) for i, rank in missed])
        if errors:
            raise next((e for e in errors if isinstance(e, WorkerError) and e.died), errors[0])
        for held in self._held:
            _hold(held, layout)

    def _open_channels(self) -> list[list[Channel]]:
        """A refit channel to every engine rank (``rollgen.distributed.channel``), where every
        engine has them and they connect; else none (buckets go through the actors)."""
        authkey = os.urandom(32)
        try:
            addresses = self.group.call_all(EngineWorker.open_channels, authkey)
        except WorkerError as exc:
            if exc.died:
                raise
            logger.warning(
                "%s: refits go through the engines' actors: an engine opened no channel: %s", self.name, exc
            )
            return []
        return channel.connect(addresses, authkey, self.group.names) if all(addresses) else []

    def _pickled(self, bucket: WeightBucket, worker: int) -> bytes:
        if bucket.layout and self._in_place is not None and self._in_place.holds(bucket):
            return self._in_place.pickled(worker)
        if bucket.layout and self._staging is not None:
            return self._staging.pickled(bucket, self.engine_info[worker]["devices"], worker)
        return pickle.dumps(bucket)

    # ---- staging buffers (refit over CUDA IPC) ----------------------------------------------------
    def _packing(self, groups: list[list[tuple[str, torch.Tensor]]], dtype: torch.dtype | None) -> Packing:
        """Over CUDA IPC, where every worker reports its GPUs: in place, as one bucket, where
        the source is the tensors of the last refit (``rollgen.in_place``); else into the
        staging buffers, made (or replaced by larger ones) for the largest bucket first."""
        staging, in_place = self._staging, self._in_place
        if staging is None:
            return super()._packing(groups, dtype)
        named = [pair for group in groups for pair in group]
        if in_place is not None and in_place.applies(named, dtype, self.engine_devices):
            pack = in_place.pack
            return Packing(
                [named], lambda group, check: pack(group, self.dp_size, check), True, self._release_staging
            )

        def prepare() -> None:
            self._release_in_place()
            need = max(flat_sizes(groups, dtype), default=0)
            devices = sorted(set(self.engine_devices))
            if not staging.fits(devices, need):
                self._release_staging()
                staging.allocate(devices, need)
            if in_place is not None:
                in_place.note(named)

        return Packing(
            groups, lambda group, check: staging.pack(group, dtype, check), len(groups) == 1, prepare
        )

    @serialised
    def release_refit_buffers(self) -> None:
        self._check_idle("release the refit buffers")  # the engines' decoding threads own them
        self._release_refit_buffers()

    def _release_refit_buffers(self) -> None:
        """Have the engines let go of the staging buffers and of the tensors read in place."""
        try:
            self._release_staging()
        finally:
            self._release_in_place()

    def _release_staging(self) -> None:
        """Have every engine let go of the staging buffers, then drop them."""
        if self._staging is not None:
            self._release_mapped(self._staging.keys, self._staging.release)

    def _release_in_place(self) -> None:
        """Have every engine let go of the trainer's tensors it reads in place, then forget them."""
        if self._in_place is not None and self._in_place.keys:
            try:
                self._release_mapped(self._in_place.keys, self._in_place.release)
            finally:
                torch.cuda.ipc_collect()  # what the trainer dropped meanwhile is freed now

    def _release_mapped(self, keys: list[str], release: Callable[[], None]) -> None:
        """Have every engine unmap ``keys``, then ``release`` them here (nothing runs on the
        engines: a refit's own, or shutdown's)."""
        if not keys:
            return
        for held in self._held:  # the engines let go of what they unpacked too
            held.clear()
        try:
            refs = self.group.submit(EngineWorker.release_staged, [(keys,)] * self.dp_size)
            self.group.get(refs, timeout_s=STAGED_WAIT_S)
        finally:
            release()

    @property
    def engine_devices(self) -> tuple[str, ...]:
        return tuple(uuid for info in self.engine_info for uuid in info["devices"])

    @property
    def _ranks_per_engine(self) -> int:
        return self.sync_ranks_per_engine or self.plan.spec.tensor_parallel_size

    @property
    def weight_sync_ranks(self) -> int:
        return self.dp_size * self._ranks_per_engine

    @property
    def sync_device(self) -> torch.device:
        return torch.device("cuda" if self.use_gpus else "cpu")

    def _join_weight_sync(self, spec: SyncGroupSpec) -> Callable[[], None]:
        ranks = self._ranks_per_engine
        refs = self.group.submit(
            EngineWorker.join_weight_sync, [(spec, 1 + i * ranks) for i in range(self.dp_size)]
        )

        def joined() -> None:
            self.group.get(refs)

        return joined

    def _receive_weights(self, spec: WeightSpec) -> Callable[[], bool]:
        refs = self.group.submit(EngineWorker.receive_weights, [(spec,)] * self.dp_size)
        return lambda: self.group.get(refs)[0]

    def _reset_prefix_cache(self) -> None:
        self.group.call_all(EngineWorker.reset_prefix_cache)

    def _clear_kv_cache(self) -> None:
        self.group.call_all(EngineWorker.clear_kv_cache)

    def _sleep(self) -> None:
        self.group.call_all(EngineWorker.sleep)

    def _wake(self, tags: list[str]) -> None:
        self.group.call_all(EngineWorker.wake, tags)

    def _shutdown(self) -> None:
        try:
            self._release_refit_buffers()
        except WorkerError as exc:  # a dead or hung worker: what it mapped goes with its process
            logger.warning("%s: the engines could not release the refit buffers: %s", self.name, exc)
        finally:
            self._release()

    def _release(self) -> None:
        channel.close(getattr(self, "_channels", None) or [])
        dispatcher = getattr(self, "_dispatcher", None)
        if dispatcher is not None:
            dispatcher.close()
        group = getattr(self, "group", None)
        if group is not None:
            group.shutdown(EngineWorker.shutdown, self.shutdown_wait_s or SHUTDOWN_WAIT_S)
            here = ray.get_runtime_context().get_node_id()
            wait_for_exit([i["pid"] for i in getattr(self, "engine_info", []) if i["node"] == here])
        if self._own_cluster and getattr(self, "cluster", None) is not None:
            self.cluster.shutdown()


def _hold(held: dict[str, None], layout: str) -> None:
    """Note that an engine holds ``layout`` (none for a bucket of its own), as many as its ranks
    keep (``refit.KEPT_UNPACKED``: the least recently used goes)."""
    if layout:
        held.pop(layout, None)
        held[layout] = None
        if len(held) > KEPT_UNPACKED:
            del held[next(iter(held))]
