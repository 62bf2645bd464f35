"""The driver ↔ worker protocol of backends whose engines live in Ray actors: what a worker is
started with (``WorkerSpec``), what one generate call carries (``GenerateRequest``), and
``EngineWorker``, the actor class that owns one engine and implements the protocol over a few
engine hooks (vLLM's and SGLang's workers subclass it)."""

from __future__ import annotations

import functools
import logging
import os
import pickle
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar, cast

import ray
import torch

from rollgen.data import BatchedDataDict, unpad
from rollgen.distributed.progress import PackedProgress
from rollgen.distributed.worker_groups import TiedGroup
from rollgen.errors import RefitError
from rollgen.output import assemble_from_lists
from rollgen.processes import descendants, engine_processes, running, shared_memory
from rollgen.refit import Named, WeightBucket, WeightSpec, release_staged
from rollgen.refit.adapters import no_lora
from rollgen.refit.transports.collective import SyncGroupSpec
from rollgen.rollout import FinishedSample, SampleProgress, SampleRequest
from rollgen.sampling import SampleParams
from rollgen.streaming_loop import StepLoop, StepOutput

logger = logging.getLogger(__name__)

_Method = TypeVar("_Method", bound=Callable[..., Any])


def _engine_call(method: _Method) -> _Method:
    """A protocol method of ``EngineWorker``, after which an error that says the engine ended
    ends the worker (``EngineWorker._ending``)."""

    @functools.wraps(method)
    def call(self: EngineWorker, *args: Any, **kwargs: Any) -> Any:
        return self._ending(method)(self, *args, **kwargs)

    return cast(_Method, call)


@dataclass(frozen=True)
class WorkerSpec:
    """Everything one engine worker is started with (picklable, made by the driver)."""

    model_name: str
    #: The engine's weight dtype (``"bfloat16"``, ...).
    dtype: str
    #: The context length the engine is started with.
    context_length: int
    seed: int | None
    logprobs_mode: str
    pad_token_id: int
    #: The backend's engine sub-dict (``vllm_cfg``, ``sglang_cfg``), every default filled in.
    engine: Mapping[str, Any]
    #: Passed to the engine's constructor as is, last (``vllm_kwargs``, ``sglang_kwargs``).
    engine_kwargs: Mapping[str, Any]
    #: The config's ``lora`` (``rollgen.spec.LoraConfig``; None: the engine serves no adapters).
    lora: Mapping[str, Any] | None
    use_gpus: bool
    group: TiedGroup
    #: The data-parallel index of this engine.
    index: int

    @property
    def tensor_parallel_size(self) -> int:
        return int(self.engine["tensor_parallel_size"])

    @property
    def sleep_enabled(self) -> bool:
        return bool(self.engine["enable_sleep_mode"])


@dataclass(frozen=True)
class GenerateRequest:
    """One data-parallel shard of a validated batch and each of its samples' settings."""

    input_ids: torch.Tensor
    input_lengths: torch.Tensor
    params: tuple[SampleParams, ...]

    def __len__(self) -> int:
        return len(self.params)

    def prompts(self) -> list[list[int]]:
        """Each sample's unpadded prompt token ids."""
        return [list(p) for p in unpad(self.input_ids, self.input_lengths)]

    @classmethod
    def shards(
        cls, batch: BatchedDataDict[Any], params: Sequence[SampleParams], count: int
    ) -> list[GenerateRequest]:
        """``count`` contiguous requests in order (sizes differ by one at most, larger first;
        some empty when the batch is smaller than ``count``)."""
        pieces: list[BatchedDataDict[Any]] = BatchedDataDict(
            {"input_ids": batch["input_ids"], "input_lengths": batch["input_lengths"], "params": list(params)}
        ).shard_by_batch_size(count, allow_uneven_shards=True)
        return [cls(p["input_ids"], p["input_lengths"], tuple(p["params"])) for p in pieces]


class EngineWorker(ABC):
    """A Ray actor owning one engine (the leader of a tied group). The driver calls the public
    methods; an engine implements the ``_``-prefixed hooks. Sleep and wake are no-ops unless
    the spec enables sleep mode; ``shutdown`` runs the engine's stop once.

    Streamed samples (``start_samples``, ``abort_samples``, ``poll``) are decoded by a thread of
    the worker that steps the engine (``rollgen.streaming_loop.StepLoop`` over ``_add_samples``,
    ``_step``, ``_abort_samples``) while it has any; ``poll`` runs in a concurrency group of its
    own (``results``), so it waits for ended samples while the other calls run. The core never
    refits weights, sleeps or runs ``generate`` while samples stream (an adapter loads between
    two steps).

    The engine's own processes (those of this actor's descendants whose command line starts
    with one of ``engine_processes``) are watched from a thread: if one ends while the engine
    runs, the worker logs which and exits, so the driver's next or pending call fails at once
    with a ``WorkerError`` naming this worker instead of waiting on a dead engine. A call (or a
    step) that meets the engine's own error for that (``_engine_ended``: vLLM's
    ``EngineDeadError``) before the watcher's next look exits the same way, so it fails as the
    worker's death too, not as an error of the call."""

    #: Command-line prefixes of the engine's processes (process titles such as
    #: ``VLLM::EngineCore``).
    engine_processes: ClassVar[tuple[str, ...]] = ()
    #: Seconds between two looks at the engine's processes.
    watch_interval_s: ClassVar[float] = 1.0
    #: Ray concurrency groups beside the default one (of one thread): ``poll`` waits in its own.
    concurrency_groups: ClassVar[dict[str, int]] = {"results": 1}
    #: The engine's prefix cache keys each prompt by ``SampleParams.weight_version`` (updates
    #: then reset no prefix cache: ``rollgen.refit.EngineFacts.versioned_prefixes``); a worker
    #: may set it in ``_start`` where its engine's settings decide.
    versioned_prefixes: bool = False

    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        self._started_at = time.time()
        self._stopped = False
        #: The samples that ended, and the new tokens of those that stream them, not polled yet
        #: (``poll`` waits on it).
        self._mailbox = threading.Condition()
        self._ended: list[FinishedSample] = []
        self._moved: dict[str, tuple[list[int], list[float]]] = {}
        self._streaming = StepLoop(
            self._ending(self._add_samples),
            self._ending(self._step),
            self._ending(self._abort_samples),
            self._report,
            f"engine {spec.index}",
            self._report_progress,
        )
        self._start()
        watched = engine_processes(os.getpid(), self.engine_processes)
        if watched:
            threading.Thread(target=self._watch, args=(watched,), daemon=True, name="rollgen-watch").start()

    def _watch(self, watched: dict[int, str]) -> None:
        while not self._stopped:
            gone = [(pid, cmd) for pid, cmd in watched.items() if not running(pid)]
            if gone and not self._stopped:
                pid, cmd = gone[0]
                self._exit(f"its process {cmd.split()[0]!r} (pid {pid}) ended")
            time.sleep(self.watch_interval_s)

    def _exit(self, why: str) -> None:
        """End this worker's process (the engine is dead): the driver's pending and later calls
        fail as its death."""
        logger.error(
            "engine %d: %s; this worker exits so that calls fail instead of waiting on a dead engine",
            self.spec.index,
            why,
        )
        os._exit(1)

    def _engine_ended(self, exc: BaseException) -> bool:
        """Whether ``exc``, raised by a call into the engine, says one of the engine's processes
        ended (before the watcher's next look); none does here."""
        return False

    def _ending(self, hook: Callable[..., Any]) -> Callable[..., Any]:
        """``hook``, after which an error that says the engine ended ends this worker."""

        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                return hook(*args, **kwargs)
            except BaseException as exc:
                if self._engine_ended(exc):
                    self._exit(f"it raised {type(exc).__name__}: {exc}")
                raise

        return call

    # ---- the protocol (what the driver calls) ---------------------------------------------------
    def ready(self) -> dict[str, Any]:
        """What the engine reports of itself once started (versions, ...), where this worker's
        process runs (``node``, ``pid``), the engine's processes (``pids``: this one and those
        below it) and the shared memory they made and hold (``shared_memory``: name -> inode,
        what a process killed leaves in ``/dev/shm``, which the driver reclaims once they are
        gone: ``rollgen.distributed.replicas``)."""
        pids = [os.getpid(), *descendants(os.getpid())]
        return {
            "node": ray.get_runtime_context().get_node_id(),
            "pid": os.getpid(),
            "pids": pids,
            "shared_memory": shared_memory(pids, self._started_at),
            "devices": self._devices() if self.spec.use_gpus else [],
            "capacity": self._capacity(),
            "versioned_prefixes": self.versioned_prefixes,
            **self._describe(),
        }

    @_engine_call
    def generate(self, request: GenerateRequest) -> BatchedDataDict[Any]:
        """Generate for one shard; output in the contract's layout."""
        tokens, logprobs = self._generate(request.prompts(), request.params)
        return assemble_from_lists(
            request.input_ids, request.input_lengths, tokens, logprobs, self.spec.pad_token_id
        )

    @_engine_call
    def apply_bucket(self, layout: str, data: bytes, transport: str, reset_prefix: bool = False) -> None:
        """Load one pickled, validated ``WeightBucket`` of ``transport`` (one pickle per worker:
        shared-memory handles open once per receiver, and a kept layout's bucket carries this
        worker's own exports; ``layout``: its layout, which the worker may keep,
        ``refit.Receiver``); ``reset_prefix``: then drop every cached prefix (an update's
        last bucket: one round trip for both)."""
        self._load_request(layout, data, transport)
        if reset_prefix:
            self._reset_prefix_cache()

    @_engine_call
    def load_adapter(self, version: int, data: bytes, drop: Sequence[int] = ()) -> None:
        """Free adapter versions ``drop``, then hold the pickled, validated adapter bucket
        ``data`` (the whole adapter; this worker's own pickle) as adapter ``version``; samples
        whose ``SampleParams.adapter`` is ``version`` decode with it. Samples may be running (a
        ``keep`` update leaves them on their version): both happen between two engine steps."""
        self._require_lora()
        bucket = pickle.loads(data).resolve()

        def load() -> None:
            for old in drop:
                self._drop_adapter(old)
            self._load_adapter_bucket(version, bucket)

        self._streaming.call(load)

    @_engine_call
    def drop_adapter(self, version: int) -> None:
        """Free adapter ``version`` (no sample decodes with it any more), between two steps."""
        self._require_lora()
        self._streaming.call(lambda: self._drop_adapter(version))

    def _require_lora(self) -> None:
        if self.spec.lora is None:
            raise no_lora(type(self).__name__)

    @_engine_call
    def open_channels(self, authkey: bytes, capacity: int) -> list[str]:
        """The address of a refit channel to each of this engine's ranks, which loads what
        ``apply_bucket`` loads without the Ray call and the engine's RPC, and a kept layout by
        name alone, ``capacity`` of them (``rollgen.refit.channel``; ``authkey`` authenticates
        the driver, whose mirror of the kept layouts has that capacity); empty where the engine
        has none."""
        return self._open_channels(authkey, capacity)

    @_engine_call
    def release_staged(self, keys: list[str]) -> None:
        """Unmap the trainer's staging buffers ``keys`` (it frees them once every worker has)."""
        self._release_staged(keys)

    @_engine_call
    def join_weight_sync(self, spec: SyncGroupSpec, first_rank: int) -> None:
        """Join a weight-sync group: this engine's TP rank r as ``first_rank + r``."""
        self._join_weight_sync(spec, first_rank)

    @_engine_call
    def receive_weights(self, spec: WeightSpec) -> bool:
        """Receive one update over the weight-sync group on every rank (``collective.receive``,
        checked against ``spec``); whether it was partial."""
        return self._receive_weights(spec)

    @_engine_call
    def reset_prefix_cache(self) -> None:
        self._reset_prefix_cache()

    @_engine_call
    def clear_kv_cache(self) -> None:
        """Drop every cached prefix and zero the KV cache (after outputs with NaN logprobs)."""
        self._reset_prefix_cache()
        self._clear_kv_cache()

    @_engine_call
    def sleep(self) -> None:
        """Reset the prefix cache and, with sleep mode, release the engine's device memory."""
        self._reset_prefix_cache()
        if self.spec.sleep_enabled:
            self._release_memory()

    @_engine_call
    def wake(self, tags: list[str]) -> None:
        if self.spec.sleep_enabled:
            self._resume_memory(tags)

    def shutdown(self) -> None:
        if not self._stopped:
            self._stopped = True
            self._streaming.stop()
            self._stop()

    # ---- streamed samples -----------------------------------------------------------------------
    @_engine_call
    def start_samples(self, requests: list[SampleRequest]) -> None:
        """Start decoding ``requests`` (returns at once; ``poll`` reports them as they end)."""
        self._streaming.start(requests)

    @_engine_call
    def abort_samples(self, keys: list[str]) -> None:
        """End the samples ``keys`` that still run (each reported aborted, with its tokens)."""
        self._streaming.abort(keys)

    @ray.method(concurrency_group="results")  # type: ignore[untyped-decorator]
    def poll(self, timeout_s: float) -> tuple[PackedProgress, list[FinishedSample], int]:
        """The new tokens of streaming samples (one report per sample: all it made since the
        last poll), then the samples that ended, since the last poll (waits up to ``timeout_s``
        for either), then how many tokens the engine made so far (for all its samples: the
        driver kills an engine that makes none for ``call_timeout_s`` as wedged)."""
        with self._mailbox:
            self._mailbox.wait_for(lambda: bool(self._ended or self._moved), timeout_s)
            ended, self._ended = self._ended, []
            moved, self._moved = self._moved, {}
        return PackedProgress.pack(moved), ended, self._streaming.tokens_made

    def _report(self, ended: list[FinishedSample]) -> None:
        with self._mailbox:
            self._ended += ended
            self._mailbox.notify_all()

    def _report_progress(self, moved: list[SampleProgress]) -> None:
        with self._mailbox:
            for report in moved:
                tokens, logprobs = self._moved.setdefault(report.key, ([], []))
                tokens.extend(report.token_ids)
                logprobs.extend(report.logprobs)
            self._mailbox.notify_all()

    # ---- engine hooks -------------------------------------------------------------------------
    @abstractmethod
    def _start(self) -> None:
        """Start the engine from ``self.spec``."""

    @abstractmethod
    def _describe(self) -> dict[str, Any]:
        """The engine's versions and anything else worth logging once."""

    @abstractmethod
    def _generate(
        self, prompts: list[list[int]], params: Sequence[SampleParams]
    ) -> tuple[list[list[int]], list[list[float]]]:
        """Each sample's generated token ids and their logprobs."""

    @abstractmethod
    def _load_bucket(self, bucket: WeightBucket) -> None:
        """Load a validated bucket of full (unsharded) HF-named tensors into every rank."""

    def _load_request(self, layout: str, data: bytes, transport: str) -> None:
        """Load a pickled bucket of ``layout`` (``apply_bucket``): here through ``_load_bucket``;
        engines whose ranks can take the pickle as it is pass it on (and may keep the layout)."""
        self._load_bucket(pickle.loads(data).resolve())

    def _load_adapter_bucket(self, version: int, bucket: WeightBucket) -> None:
        """Load a validated adapter bucket as ``version``: here through ``_load_adapter``;
        engines whose ranks unpack buckets themselves send it on (a bucket's pickle holds
        handles where a pickle of its tensors, views of one buffer, holds that buffer each)."""
        self._load_adapter(version, bucket.unpack())

    def _load_adapter(self, version: int, named: Named) -> None:
        """Hold a checked adapter (PEFT's names, ``rollgen.refit.adapters``) as ``version``,
        copied (the source may change after); engines with the ``adapters`` capability."""
        raise self._no_adapters()

    def _drop_adapter(self, version: int) -> None:
        """Free adapter ``version``."""
        raise self._no_adapters()

    def _no_adapters(self) -> RefitError:
        return RefitError(
            f"{type(self).__name__} serves no LoRA adapters; use a backend with the adapters capability"
        )

    def _open_channels(self, authkey: bytes, capacity: int) -> list[str]:
        """Open a refit channel to each rank, each keeping ``capacity`` layouts
        (``rollgen.refit.receiver.Receiver``; ``open_channels``); none here."""
        return []

    def _release_staged(self, keys: list[str]) -> None:
        """Unmap staging buffers wherever this engine mapped them (here, by default)."""
        release_staged(keys)

    @abstractmethod
    def _reset_prefix_cache(self) -> None:
        """Drop every cached prefix."""

    def _capacity(self) -> int:
        """How many streamed samples the engine decodes at once (more wait on the driver, for an
        engine that frees up first)."""
        return 256

    def _add_samples(self, requests: list[SampleRequest]) -> None:
        """Add streamed samples to the engine (keyed by ``SampleRequest.key``)."""
        raise NotImplementedError(f"{type(self).__name__} does not stream samples (async)")

    def _abort_samples(self, keys: list[str]) -> None:
        """Remove running samples from the engine."""
        raise NotImplementedError(f"{type(self).__name__} does not stream samples (async)")

    def _step(self) -> list[StepOutput]:
        """One engine step: (key, new tokens, their logprobs, ended) of each sample it moved."""
        raise NotImplementedError(f"{type(self).__name__} does not stream samples (async)")

    def _devices(self) -> list[str]:
        """UUIDs of the GPUs of this engine's ranks (CUDA IPC refits are checked against them
        before anything is sent); empty where unknown."""
        return []

    def _join_weight_sync(self, spec: SyncGroupSpec, first_rank: int) -> None:
        """Have every rank join the weight-sync group (for ``refit_collective``)."""
        raise NotImplementedError(f"{type(self).__name__} has no weight-sync group (refit_collective)")

    def _receive_weights(self, spec: WeightSpec) -> bool:
        """Have every rank ``collective.receive`` one update (for ``refit_collective``)."""
        raise NotImplementedError(f"{type(self).__name__} has no weight-sync group (refit_collective)")

    def _clear_kv_cache(self) -> None:  # noqa: B027 - optional: engines that keep no stale KV need nothing
        """Zero the KV cache's contents."""

    @abstractmethod
    def _release_memory(self) -> None:
        """Sleep mode: free the weights' and the KV cache's device memory."""

    @abstractmethod
    def _resume_memory(self, tags: list[str]) -> None:
        """Sleep mode: take back the memory of ``tags`` (``"weights"``, ``"kv_cache"``)."""

    @abstractmethod
    def _stop(self) -> None:
        """Stop the engine and its processes."""
