"""``BaseGeneration``: the behaviour every backend shares, over a few engine hooks."""

from __future__ import annotations

import functools
import logging
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, ClassVar, TypeVar, cast

import torch

from rollgen import text
from rollgen.data import BatchedDataDict, unpad
from rollgen.errors import EngineClosed, RolloutsInFlight, UnsupportedCapability, WorkerError
from rollgen.model_info import ModelInfo
from rollgen.output import empty_output, finish_output, stop_reason
from rollgen.refit import SyncBackend, SyncGroupSpec, Transport, WeightBucket, WeightSpec
from rollgen.refit.adapters import RefitTarget, is_adapter
from rollgen.refit.bucket import as_buckets
from rollgen.refit.link import EngineLink
from rollgen.refit.transports import transport_named
from rollgen.refit.updates import WeightUpdates
from rollgen.rollout import InFlightSample, ReplicaLoad, Rollout, SampleRequest, Streams, UpdateMode
from rollgen.sampling import SampleParams, resolve_sampling
from rollgen.spec import PER_SAMPLE_SAMPLING_KEYS, Capability
from rollgen.validation import Limits, check_batch_limits, check_config_limits, check_replica
from rollgen.wake import WAKE_TAGS, WakeState

logger = logging.getLogger(__name__)

_Method = TypeVar("_Method", bound=Callable[..., Any])


def serialised(method: _Method) -> _Method:
    """Run ``method`` under the generation's lock: calls from several threads on one generation
    object run one at a time, in the order they take the lock. A worker that died
    (``WorkerError.died``) ends the generation: later calls raise that error at once. Threads in
    ``wait_ready`` look again once the call ends (it may have woken the engine or refitted it)."""

    @functools.wraps(method)
    def locked(self: BaseGeneration, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            try:
                return method(self, *args, **kwargs)
            except WorkerError as exc:
                self._worker_failed(exc)
                raise
            finally:
                self._state_changed()

    return cast(_Method, locked)


class BaseGeneration(ABC):
    """Shared behaviour of every backend (it implements ``GenerationInterface``): validation,
    per-sample settings, seeds, the lock, wake/sleep, streamed rollouts, the text path; weight
    updates go to ``updates`` (``rollgen.refit.WeightUpdates``).

    A backend implements the engine hooks (the last section below): ``_generate`` (required),
    ``_stream_start`` and ``_stream_abort`` (``async``), ``replica_load``, ``_sleep``,
    ``_wake``, ``_shutdown``; the engine's facts ``reads_weights``, ``releases_memory_on_sleep``,
    ``sampling_limits``, ``shutdown_wait_s``. A backend that takes refits links its engine once
    it is up (``link_engine``: for one in this process, ``rollgen.refit.InProcessLink`` made of
    its ``EngineFacts`` and its load and cache callables)."""

    #: How long ``shutdown`` waits for the engine to report the streamed samples it aborts; one
    #: not reported by then fails its rollout, named (a setting of the object: set it before
    #: ``shutdown``).
    shutdown_grace_s: float = 60.0

    def __init__(self, config: Mapping[str, Any], cluster: Any = None, backend: Any = None) -> None:
        from rollgen.registry import get_registry

        self.cfg = dict(config)
        self.cluster = cluster
        self.backend = backend or get_registry().get(self.cfg["backend"]).backend
        self.model_info = ModelInfo.from_dir(self.cfg["model_name"])
        if self.reads_weights:
            self.model_info.check_weight_files()
        self.max_model_len = self.model_info.context(self.cfg.get("max_model_len"))
        check_config_limits(self.sampling_limits, self.cfg, self.name)
        self._awake = WakeState()
        self._closed = False
        #: The death of an engine worker, which ended this generation.
        self._dead: WorkerError | None = None
        self._tokenizer: Any = None
        #: Calls from several threads run one at a time (a refit waits for a running generate).
        self._lock = threading.RLock()
        #: Notified after every call that may change ``ready`` (``wait_ready`` waits on it).
        self._readiness = threading.Condition()
        #: Samples streamed by ``submit``, and the weight version.
        self._streams = Streams(
            self._stream_start,
            self._stream_abort,
            self._stream_stop_reason,
            lambda: self.updates.nonfinite_logprobs(),
        )
        lora = self.cfg.get("lora")
        if lora is not None:
            self.require(Capability.ADAPTERS, "lora (LoRA adapters)")
        #: This generation's weight updates: their state and their lifecycle.
        spec = lambda: self.model_info.weight_spec(self.engine_dtype)  # noqa: E731 - read once, lazily
        self.updates = WeightUpdates(self.name, spec, self._streams, lora)
        seed = self.cfg.get("seed")
        self._seed_rng = None if seed is None else torch.Generator().manual_seed(int(seed))
        if self.cfg.get("logprobs_mode") == "processed":
            self.require(Capability.PROCESSED_LOGPROBS, "logprobs_mode='processed'")

    # ---- capabilities and state -------------------------------------------------------------
    @property
    def name(self) -> str:
        return self.backend.name

    @property
    def capabilities(self) -> frozenset[Capability]:
        return self.backend.capabilities

    def require(self, capability: Capability, what: str) -> None:
        """Raise ``UnsupportedCapability`` (saying ``what`` needs it) unless the backend declares
        ``capability``."""
        if capability not in self.capabilities:
            raise UnsupportedCapability(self.name, capability.value, what)

    @property
    def usable(self) -> bool:
        """False once the generation was shut down or one of its engine workers died."""
        return not self._closed and self._dead is None

    @property
    def ready(self) -> bool:
        """Whether ``generate`` and ``submit`` can run now as far as the generation's state goes:
        usable, every part awake (``prepare_for_generation``), its weights not stale."""
        return self.usable and self._awake.all_awake and self.updates.stale is None

    def wait_ready(self, timeout_s: float | None = None) -> bool:
        """Block until ``ready`` or until the generation can never be, at most ``timeout_s``
        seconds (None: no limit); returns ``ready``.

        For callers in other threads that find the engine asleep or stale (``EngineAsleep``,
        ``StaleWeights``) and would rather wait for the trainer's ``prepare_for_generation`` or
        refit than fail (``rollgen.serve`` does). It takes no lock: a call in progress (a refit)
        is waited for by the call that follows, as usual."""
        with self._readiness:
            self._readiness.wait_for(lambda: self.ready or not self.usable, timeout_s)
        return self.ready

    def _state_changed(self) -> None:
        with self._readiness:
            self._readiness.notify_all()

    def _worker_failed(self, error: WorkerError) -> None:
        """A worker failed (in a call, or while streaming samples): if it died, the generation
        ends with it (later calls raise that death at once)."""
        if error.died and self._dead is None:
            self._dead = error
            self._state_changed()

    def _check_open(self) -> None:
        if self._closed:
            raise EngineClosed(f"{self.name} generation was shut down; create a new one")
        if self._dead is not None:
            raise WorkerError(
                self._dead.worker,
                "died earlier, ending this generation: shut it down and create a new one",
                died=True,
            )

    def _check_idle(self, what: str) -> None:
        running = self._streams.in_flight
        if running:
            raise RolloutsInFlight(
                f"cannot {what}: {running} streamed sample(s) are in flight; wait for their rollouts, "
                "cancel them (Rollout.cancel()), or submit this batch too"
            )

    # ---- generation ---------------------------------------------------------------------------
    @serialised
    def generate(self, data: Mapping[str, Any], greedy: bool = False) -> BatchedDataDict[Any]:
        """Generate for a batch; returns a ``GenerationOutputSpec`` batch, checked.

        Args:
            data: a ``GenerationDatumSpec`` batch. greedy: decode every sample greedily.

        Raises:
            InputError, UnsupportedCapability: before any engine work, for a batch the engine
                cannot take. EngineAsleep, StaleWeights, RolloutsInFlight: it cannot run now."""
        self._check_open()
        self._check_idle("generate")
        batch, params = self._prepare(data, greedy)
        if batch.size == 0:
            return empty_output(batch["input_ids"].shape[1])
        self.updates.generated()  # before the call: a failed generate may have cached some
        out = self._generate(batch, params)
        finite = finish_output(
            out,
            batch,
            params,
            self.model_info.eos_token_ids,
            self.max_model_len,
            lambda i, tokens: self._hits_stop_string(params[i], tokens),
        )
        if not finite:
            self.updates.nonfinite_logprobs()
        return out

    def _prepare(
        self, data: Mapping[str, Any], greedy: bool
    ) -> tuple[BatchedDataDict[Any], list[SampleParams]]:
        """The validated batch (seeded where the config has a seed) and each sample's settings;
        raises before any engine work if the engine cannot take it now."""
        from rollgen.validation import validate_generation_input

        self._check_open()
        self.updates.require_fresh()
        self._awake.require(WAKE_TAGS, "generate")
        batch = validate_generation_input(
            data,
            pad_token_id=self.cfg["pad_token_id"],
            vocab_size=self.model_info.vocab_size,
            max_model_len=self.max_model_len,
        )
        check_batch_limits(self.sampling_limits, batch, self.name)
        if batch.get("stop_strings") is not None and any(batch["stop_strings"]):
            self.require(Capability.STOP_STRINGS, "per-sample stop_strings")
        if self.cfg.get("stop_strings"):
            self.require(Capability.STOP_STRINGS, "stop_strings")
        if any(k in batch for k in PER_SAMPLE_SAMPLING_KEYS if k != "seed"):
            self.require(Capability.PER_SAMPLE_SAMPLING, "per-sample sampling settings")
        if batch.size and "seed" not in batch and self._seed_rng is not None and not greedy:
            batch["seed"] = torch.randint(0, 2**62, (batch.size,), generator=self._seed_rng)
        return batch, self.sample_params(batch, greedy)

    def sample_params(self, batch: Mapping[str, Any], greedy: bool) -> list[SampleParams]:
        """Per-sample settings for a validated batch, as ``generate`` resolves them (the config's,
        the batch's per-sample values, the context's limit on each budget, the current adapter
        and weight version)."""
        info, streams = self.model_info, self._streams
        return resolve_sampling(
            self.cfg, batch, greedy, self.max_model_len, info.eos_token_ids, streams.adapter, streams.version
        )

    def _hits_stop_string(self, params: SampleParams, tokens: list[int]) -> bool:
        """Whether ``tokens`` (a sample's generated tokens) hold one of its stop strings
        (``rollgen.text.hits_stop_string``)."""
        return text.hits_stop_string(self.tokenizer, params.stop_strings, tokens)

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.cfg["model_name"])
        return self._tokenizer

    def generate_text(self, data: Mapping[str, Any], greedy: bool = False) -> BatchedDataDict[Any]:
        """Generate for text prompts ``{"prompts": [str, ...]}`` (optionally ``stop_strings`` per
        prompt); returns ``{"texts": [str, ...]}``, each cut before the first stop string it holds
        (special tokens skipped). InputError: other data, or a prompt that encodes to no tokens."""
        self._check_open()
        self.require(Capability.TEXT, "generate_text")
        batch = text.prompt_batch(self.tokenizer, data, self.cfg["pad_token_id"])
        if batch is None:
            return BatchedDataDict({"texts": []})
        out, stops = self.generate(batch, greedy=greedy), self.cfg.get("stop_strings") or ()
        return BatchedDataDict({"texts": text.texts(self.tokenizer, batch, out, stops)})

    # ---- streamed rollouts ----------------------------------------------------------------------
    @property
    def weight_version(self) -> int:
        """How many weight updates (refits) have completed on this generation object; every
        streamed token is stamped with the version that produced it."""
        return self._streams.version

    def samples_in_flight(self) -> list[InFlightSample]:
        """The streamed samples not yet reported, with how long each has run and whether it was
        asked to end: what a call that waits for them (``Rollout.wait``, an update, ``shutdown``)
        is waiting for."""
        return self._streams.samples()

    @serialised
    def submit(
        self,
        data: Mapping[str, Any],
        greedy: bool = False,
        *,
        tag: Any = None,
        replica: int | None = None,
        stream_tokens: bool = False,
    ) -> Rollout:
        """Start generating for a batch; returns at once the ``Rollout`` that yields each
        sample's result as it finishes.

        Args:
            data, greedy: as in ``generate``. tag: the caller's name for the rollout, on each
                result. replica: the data-parallel replica to prefer while it has room (one
                holding the prompts' prefix); None: the least loaded. stream_tokens: the
                samples' tokens are also reported as they are made (``Rollout.events``).

        Raises:
            UnsupportedCapability: without ``async``; else as ``generate``.

        Batches submitted while others run share the engine (continuous batching); a weight
        update in between says what happens to them (``mode`` of ``refit``/``update_weights``)."""
        self.require(Capability.ASYNC, "submit (streamed rollouts)")
        if replica is not None:
            check_replica(replica, max(1, len(self.replica_load())))
        batch, params = self._prepare(data, greedy)
        rollout = Rollout(self._streams, batch, self.cfg["pad_token_id"], tag, stream_tokens)
        self.updates.generated()
        self._streams.submit(rollout, unpad(batch["input_ids"], batch["input_lengths"]), params, replica)
        return rollout

    def _stream_stop_reason(self, params: SampleParams, end: int, tokens: list[int]) -> str:
        return stop_reason(
            tokens,
            end,
            params,
            self.model_info.eos_token_ids,
            self.max_model_len,
            lambda generated: self._hits_stop_string(params, generated),
        )

    # ---- sleep / wake -------------------------------------------------------------------------
    @serialised
    def prepare_for_generation(self, tags: Sequence[str] | None = None) -> None:
        """Bring ``tags`` (of ``rollgen.wake.WAKE_TAGS``; None: all) back onto the device.

        Raises:
            UnsupportedCapability: without ``sleep_wake``. InputError: for an unknown tag."""
        self._check_open()
        self.require(Capability.SLEEP_WAKE, "prepare_for_generation (wake)")
        todo = self._awake.asleep(tags)
        if todo:
            self._wake(todo)
            self._awake.woke(todo)

    @serialised
    def finish_generation(self) -> None:
        """Reset the prefix cache and free device memory (``releases_memory_on_sleep``).

        Raises:
            RolloutsInFlight: samples stream. UnsupportedCapability: without ``sleep_wake``."""
        self._check_open()
        self._check_idle("sleep (finish_generation)")
        self.require(Capability.SLEEP_WAKE, "finish_generation (sleep)")
        if self._awake.any_awake:
            self._sleep()
            self._awake.slept()
            self.updates.slept()

    # ---- refit --------------------------------------------------------------------------------
    # The public methods check the call and the engine's state, then hand the update to
    # ``updates``, which reaches the engine through its link.
    def link_engine(self, link: EngineLink, *, weights: Callable[[], WeightSpec] | None = None) -> None:
        """Have weight updates reach the engine through ``link`` (once the engine is up).

        Args:
            link: for an engine in this process, ``rollgen.refit.InProcessLink(facts, load,
                ...)``; a backend without refit links none (its capabilities refuse refits).
            weights: reads the served model's ``WeightSpec`` (None: the model folder's, in
                ``engine_dtype``)."""
        self.updates.link = link
        if weights is not None:
            self.updates.expected = weights

    @property
    def local_transport(self) -> Transport:
        """The transport ``refit()`` packs a local source with (the linked engine's)."""
        return self.updates.facts.transport

    @property
    def weight_spec(self) -> WeightSpec:
        """What a refit may send: HF checkpoint names, full (unsharded) shapes, engine dtype."""
        return self.updates.spec

    @property
    def engine_dtype(self) -> torch.dtype:
        """The dtype the engine holds weights in."""
        return self.model_info.dtype(self.cfg.get("dtype", "auto"))

    @property
    def weight_sync(self) -> SyncGroupSpec | None:
        """The spec of the weight-sync group the engines joined (``init_weight_sync``), if any."""
        return self.updates.weight_sync

    @serialised
    def update_weights(
        self,
        buckets: WeightBucket | Iterable[WeightBucket],
        *,
        partial: bool = False,
        mode: UpdateMode = "wait",
        target: RefitTarget = "weights",
    ) -> None:
        """Apply buckets packed by ``rollgen.iter_buckets`` (in this or another process; checked
        there for NaN and infinite values).

        Args:
            buckets: one ``WeightBucket`` or several. partial: they cover whole module groups,
                not the whole model. mode: what happens to streamed samples in flight. target:
                as in ``refit`` (an adapter comes in one bucket).

        Raises:
            RefitError: before anything is applied, for buckets that do not match the served
                model. UnsupportedCapability: a transport not taken. EngineAsleep.

        A failure after the first bucket reached the engine marks the generation stale."""
        self._check_open()
        self._awake.require(["weights"], "update weights")
        items = as_buckets(buckets)
        for transport in dict.fromkeys(b.transport for b in items):
            self.require(transport_named(transport).capability, f"refit over {transport}")
        if is_adapter(target, partial, len(items)):
            self.require(Capability.ADAPTERS, "an adapter update")
            self.updates.apply_adapter_bucket(items[0], mode)
        else:
            self.updates.apply_buckets(items, partial, mode)

    @serialised
    def refit(
        self,
        source: torch.nn.Module | Mapping[str, torch.Tensor],
        *,
        bucket_bytes: int | None = None,
        dtype: torch.dtype | None = None,
        partial: bool = False,
        check_finite: bool = True,
        mode: UpdateMode = "wait",
        target: RefitTarget = "weights",
    ) -> None:
        """Push a local model or state dict into the engine, in bounded buckets over
        ``local_transport``; or, with ``target="adapter"``, a LoRA adapter (a PEFT model or its
        state dict, the config's ``lora``) as a new adapter version, in one bucket: samples in
        flight under ``keep`` finish on their version.

        Args:
            source: a module or a state dict. bucket_bytes: None: the size the first such
                refit took (a quarter of the source GPU's free memory then, 64 MiB to 4 GiB;
                1 GiB from host memory). dtype: cast while packing. partial: as in
                ``update_weights``. check_finite: reject NaN and infinite values. mode: what
                happens to streamed samples in flight (a rejected refit leaves them running).

        Raises:
            RefitError: before anything is sent, for a source that does not match the served
                model, non-finite values, or (CUDA IPC) a GPU that holds not every engine
                GPU's handle. EngineAsleep.

        Over CUDA IPC the buckets go into staging buffers kept between refits
        (``release_refit_buffers``); as the weight-sync group's sender (``init_weight_sync(...,
        local_sender=True)``) this process broadcasts the source."""
        self._check_open()
        self._awake.require(["weights"], "refit")
        self.require(transport_named(self.local_transport).capability, "refit")
        if is_adapter(target, partial):
            self.require(Capability.ADAPTERS, "refit(target='adapter')")
            self.updates.refit_adapter(source, dtype, check_finite, mode)
        else:
            self.updates.refit(source, bucket_bytes, dtype, partial, check_finite, mode)

    @serialised
    def release_refit_buffers(self) -> None:
        """Free the buffers ``refit`` keeps between refits (CUDA IPC staging buffers: one of
        the largest bucket on each engine GPU); the next refit makes new ones.

        Raises:
            RolloutsInFlight: samples stream (the engines' decoding threads own the buffers)."""
        self._check_idle("release the refit buffers")
        self.updates.release()

    def weight_sync_spec(
        self, address: str, port: int = 0, *, backend: SyncBackend | None = None, timeout_s: float = 600.0
    ) -> SyncGroupSpec:
        """The spec of a weight-sync group of every engine rank and the trainer's sending rank,
        for ``rollgen.WeightSender`` there (whose ``spec`` then goes to ``init_weight_sync``).

        Args:
            address, port: where the sender hosts the group's TCP store (port 0: a free one,
                which the sender's ``spec`` carries). backend: None: NCCL if the engines run
                on GPUs, else gloo.

        Raises:
            UnsupportedCapability: without ``refit_collective``."""
        self.require(Capability.REFIT_COLLECTIVE, "a weight-sync group")
        return self.updates.sync_spec(address, port, backend, timeout_s)

    @serialised
    def init_weight_sync(self, spec: SyncGroupSpec, *, local_sender: bool = False) -> None:
        """Have every engine rank join ``spec``'s weight-sync group while the trainer's sender
        joins it (``sender.connect()``); returns once all have joined.

        Args:
            spec: the sender's ``spec`` (it has the port it listens on). local_sender: this
                process is the sender (port 0: a free one; over NCCL, the current CUDA device),
                and ``refit`` broadcasts.

        Raises:
            RefitError: a spec these engines cannot join (world size, port, an NCCL group with
                two ranks on one GPU). UnsupportedCapability: without ``refit_collective``.

        Then each ``WeightSender.send`` pairs with an ``update_weights_from_collective``. A new
        group replaces the last (after a trainer restarts, or a failure broke the group)."""
        self._check_open()
        self.require(Capability.REFIT_COLLECTIVE, "init_weight_sync")
        self.updates.init_weight_sync(spec, local_sender)

    @serialised
    def update_weights_from_collective(self, *, mode: UpdateMode = "wait") -> None:
        """Receive the update the trainer's ``WeightSender.send`` broadcasts (call both at once),
        with streamed samples in flight handled per ``mode``; returns once it is applied.

        Raises:
            RefitError: no group, or this process is its sender; or the update does not match
                the served model (checked before any byte is applied). EngineClosed,
                EngineAsleep: at once, before the engines take part (``send`` then times out).

        A failure while applying marks the generation stale."""
        self._check_open()
        self._awake.require(["weights"], "update weights")
        self.updates.update_from_collective(mode)

    # ---- shutdown -----------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Abort the streamed samples, wait for their reports (``shutdown_grace_s``), free the
        engine. A call in progress is waited for (at most ``shutdown_wait_s``)."""
        wait_s = self.shutdown_wait_s
        locked = self._lock.acquire(timeout=-1 if wait_s is None else wait_s)
        if not locked:
            logger.warning(
                "%s: a call still runs after %.0f s; shutting down without waiting for it (it fails)",
                self.name,
                wait_s,
            )
        try:
            self._close()
        finally:
            if locked:
                self._lock.release()

    def _close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._state_changed()
        self.updates.close()
        self._streams.close(self.shutdown_grace_s)
        self._shutdown()

    def __enter__(self) -> BaseGeneration:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ==== engine hooks ==========================================================================
    #: Bounds of sampling settings tighter than the contract's that this engine enforces
    #: (``{"temperature": (low, high)}``, None for no bound): checked in the config at creation
    #: and in each batch's per-sample values, before any engine work.
    sampling_limits: ClassVar[Limits] = {}
    #: Seconds ``shutdown`` waits for a call in progress before it shuts down without it (None:
    #: for ever). Engines in other processes, which shutdown kills, set it: the call then fails.
    shutdown_wait_s: ClassVar[float | None] = None

    @property
    def reads_weights(self) -> bool:
        """Whether the engine loads its weights from the model folder (checked at creation)."""
        return True

    @property
    def releases_memory_on_sleep(self) -> bool:
        """Whether ``finish_generation`` really frees device memory here (False: honest no-op)."""
        return False

    @abstractmethod
    def _generate(self, batch: BatchedDataDict[Any], params: list[SampleParams]) -> BatchedDataDict[Any]:
        """Generate for a validated, non-empty batch, each sample by its settings ``params``;
        return GenerationOutputSpec."""

    def _stream_start(self, requests: list[SampleRequest]) -> None:
        """Start generating ``requests`` and report each one's end to ``self._streams.deliver``
        (from any thread); backends that declare ``async`` implement it."""
        raise UnsupportedCapability(self.name, Capability.ASYNC.value, "streamed rollouts")

    def _stream_abort(self, keys: list[str]) -> None:
        """End the samples ``keys`` now: report each (``aborted=True``, with the tokens it has)
        unless it ended already."""
        raise UnsupportedCapability(self.name, Capability.ASYNC.value, "streamed rollouts")

    def replica_load(self) -> list[ReplicaLoad]:
        """Each data-parallel replica's streamed samples (running, capacity, started so far),
        in replica order; empty where the backend runs one engine that places nothing."""
        return []

    def _wake(self, tags: list[str]) -> None:  # noqa: B027 - optional hook, a no-op unless the engine needs it
        """Bring ``tags`` back onto the device."""

    def _sleep(self) -> None:  # noqa: B027 - optional hook, a no-op unless the engine needs it
        """Reset the prefix cache and release memory."""

    def _shutdown(self) -> None:  # noqa: B027 - optional hook, a no-op unless the engine needs it
        """Free the engine."""
