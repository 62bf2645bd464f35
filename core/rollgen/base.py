"""``BaseGeneration``: the behaviour every backend shares, over a few engine hooks."""

from __future__ import annotations

import functools
import logging
import math
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, ClassVar, TypeVar, cast

import torch

from rollgen.data import BatchedDataDict, right_pad, unpad
from rollgen.errors import (
    ConfigError,
    EngineAsleep,
    EngineClosed,
    InputError,
    RefitError,
    RolloutsInFlight,
    StaleWeights,
    UnsupportedCapability,
    WorkerError,
)
from rollgen.model_info import ModelInfo
from rollgen.output import empty_output, finish_output, stop_reason
from rollgen.refit import (
    TRANSPORT_CAPABILITY,
    SyncBackend,
    SyncGroupSpec,
    TensorMeta,
    Transport,
    WeightBucket,
    WeightSpec,
)
from rollgen.refit.link import EngineLink, InProcessLink
from rollgen.refit.updates import WeightUpdates
from rollgen.rollout import InFlightSample, ReplicaLoad, Rollout, SampleRequest, Streams, UpdateMode
from rollgen.sampling import SampleParams, resolve_sampling, truncate_at_stop
from rollgen.spec import PER_SAMPLE_SAMPLING_KEYS, Capability

logger = logging.getLogger(__name__)

WAKE_TAGS = ("weights", "kv_cache")
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
    per-sample settings, seeds, wake/sleep state, refit checks, the text path. A backend
    implements ``_generate``, ``_apply_bucket`` and the other ``_``-prefixed engine hooks."""

    #: Transport ``refit()`` packs local sources with; backends override.
    local_transport: Transport = "tensors"
    #: Whether the engine runs in this process (its end of a weight-sync group joins here).
    engines_in_process: ClassVar[bool] = True
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
        context = self.model_info.max_position_embeddings
        if (self.cfg.get("max_model_len") or 0) > context:
            raise ConfigError(
                f"max_model_len={self.cfg['max_model_len']} is above the model's context of {context} "
                "tokens (max_position_embeddings in its config.json)"
            )
        self.max_model_len = int(self.cfg.get("max_model_len") or context)
        self._check_limits_of_config()
        self._awake = set(WAKE_TAGS)
        self._closed = False
        #: The death of an engine worker, which ended this generation.
        self._dead: WorkerError | None = None
        self._tokenizer: Any = None
        self._weight_spec: WeightSpec | None = None
        #: Calls from several threads run one at a time (a refit waits for a running generate).
        self._lock = threading.RLock()
        #: Notified after every call that may change ``ready`` (``wait_ready`` waits on it).
        self._readiness = threading.Condition()
        #: Samples streamed by ``submit``, and the weight version.
        self._streams = Streams(
            self._stream_start, self._stream_abort, self._stream_stop_reason, self._nonfinite_logprobs
        )
        seed = self.cfg.get("seed")
        self._seed_rng = None if seed is None else torch.Generator().manual_seed(int(seed))
        if self.cfg.get("logprobs_mode") == "processed":
            self.require(Capability.PROCESSED_LOGPROBS, "logprobs_mode='processed'")

    #: Bounds of sampling settings tighter than the contract's that this engine enforces
    #: (``{"temperature": (low, high)}``, None for no bound): checked in the config at creation
    #: and in each batch's per-sample values, before any engine work.
    sampling_limits: ClassVar[Mapping[str, tuple[float | None, float | None]]] = {}

    @property
    def reads_weights(self) -> bool:
        """Whether the engine loads its weights from the model folder (checked at creation)."""
        return True

    def _check_limits_of_config(self) -> None:
        problems = [
            f"{key}: {self.cfg[key]} is outside {_bounds(lo, hi)}, which the {self.name} engine takes"
            for key, (lo, hi) in self.sampling_limits.items()
            if self.cfg.get(key) is not None and not _within(self.cfg[key], lo, hi)
        ]
        if problems:
            raise ConfigError(f"invalid config for backend {self.name!r}", problems)

    def _check_limits_of_batch(self, batch: Mapping[str, Any]) -> None:
        for key, (lo, hi) in self.sampling_limits.items():
            if key in batch:
                values = torch.as_tensor(batch[key]).double()
                bad = (values < (-math.inf if lo is None else lo)) | (
                    values > (math.inf if hi is None else hi)
                )
                if bad.any():
                    rows = bad.nonzero().flatten().tolist()
                    raise InputError(
                        f"sample(s) {rows}: per-sample {key} outside {_bounds(lo, hi)}, which the "
                        f"{self.name} engine takes",
                        rows,
                    )

    # ---- capabilities and state -------------------------------------------------------------
    @property
    def name(self) -> str:
        return self.backend.name

    @property
    def capabilities(self) -> frozenset[Capability]:
        return self.backend.capabilities

    def require(self, capability: Capability, what: str) -> None:
        if capability not in self.capabilities:
            raise UnsupportedCapability(self.name, capability.value, what)

    @property
    def releases_memory_on_sleep(self) -> bool:
        """Whether ``finish_generation`` really frees device memory here (False: honest no-op)."""
        return False

    @property
    def usable(self) -> bool:
        """False once the generation was shut down or one of its engine workers died."""
        return not self._closed and self._dead is None

    @property
    def ready(self) -> bool:
        """Whether ``generate`` and ``submit`` can run now as far as the generation's state goes:
        usable, every part awake (``prepare_for_generation``), its weights not stale."""
        stale = "updates" in self.__dict__ and self.updates.stale is not None  # made by the first call
        return self.usable and self._awake >= set(WAKE_TAGS) and not stale

    def wait_ready(self, timeout_s: float | None = None) -> bool:
        """Block until ``ready`` or until the generation can never be (shut down, a worker
        died), at most ``timeout_s`` seconds (None: no limit); returns ``ready``. For callers in
        other threads that find the engine asleep or stale (``EngineAsleep``, ``StaleWeights``)
        and would rather wait for the trainer's ``prepare_for_generation`` or refit than fail
        (``rollgen.serve`` does). It takes no lock: a call in progress (a refit) is waited for
        by the call that follows, as usual."""
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

    def _check_fresh(self) -> None:
        if self.updates.stale is not None:
            raise StaleWeights(
                f"{self.name}: {self.updates.stale}; the engine may hold a mix of old and new weights. "
                "Call refit() (or update_weights()) with the complete weights before generating"
            )

    def _check_awake(self, tags: Iterable[str], what: str) -> None:
        asleep = [t for t in tags if t not in self._awake]
        if asleep:
            raise EngineAsleep(f"cannot {what}: {', '.join(asleep)} asleep; call prepare_for_generation()")

    # ---- generation ---------------------------------------------------------------------------
    @serialised
    def generate(self, data: Mapping[str, Any], greedy: bool = False) -> BatchedDataDict[Any]:
        self._check_open()
        self._check_idle("generate")
        batch, params = self._prepare(data, greedy)
        if batch.size == 0:
            return empty_output(batch["input_ids"].shape[1])
        self.updates.prefixes_cached = True  # before the call: a failed generate may have cached some
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
            self._nonfinite_logprobs()
        return out

    def _nonfinite_logprobs(self) -> None:
        """An output held NaN or infinite logprobs: the next complete refit clears the KV cache."""
        self.updates.kv_poisoned = True
        logger.warning("%s: NaN or infinite logprobs; are the weights finite?", self.name)

    def _prepare(
        self, data: Mapping[str, Any], greedy: bool
    ) -> tuple[BatchedDataDict[Any], list[SampleParams]]:
        """The validated batch (seeded where the config has a seed) and each sample's settings;
        raises before any engine work if the engine cannot take it now."""
        from rollgen.validation import validate_generation_input

        self._check_open()
        self._check_fresh()
        self._check_awake(WAKE_TAGS, "generate")
        batch = validate_generation_input(
            data,
            pad_token_id=self.cfg["pad_token_id"],
            vocab_size=self.model_info.vocab_size,
            max_model_len=self.max_model_len,
        )
        self._check_limits_of_batch(batch)
        if batch.get("stop_strings") is not None and any(batch["stop_strings"]):
            self.require(Capability.STOP_STRINGS, "per-sample stop_strings")
        if self.cfg.get("stop_strings"):
            self.require(Capability.STOP_STRINGS, "stop_strings")
        if any(k in batch for k in PER_SAMPLE_SAMPLING_KEYS if k != "seed"):
            self.require(Capability.PER_SAMPLE_SAMPLING, "per-sample sampling settings")
        if batch.size and "seed" not in batch and self._seed_rng is not None and not greedy:
            batch["seed"] = torch.randint(0, 2**62, (batch.size,), generator=self._seed_rng)
        params = resolve_sampling(self.cfg, batch, greedy, self.max_model_len, self.model_info.eos_token_ids)
        return batch, params

    def _hits_stop_string(self, params: SampleParams, tokens: list[int]) -> bool:
        """Whether ``tokens`` (a sample's generated tokens) hold one of its stop strings: the one
        rule for every backend, the text as ``generate_text`` returns it (special tokens
        skipped)."""
        return any(s in self.tokenizer.decode(tokens, skip_special_tokens=True) for s in params.stop_strings)

    def _check_idle(self, what: str) -> None:
        running = self._streams.in_flight
        if running:
            raise RolloutsInFlight(
                f"cannot {what}: {running} streamed sample(s) are in flight; wait for their rollouts, "
                "cancel them (Rollout.cancel()), or submit this batch too"
            )

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
        self, data: Mapping[str, Any], greedy: bool = False, *, tag: Any = None, replica: int | None = None
    ) -> Rollout:
        """Start generating for a batch (``generate``'s input) and return at once; the returned
        ``Rollout`` yields each sample's result as it finishes (each carrying ``tag``, the
        caller's name for the rollout). Batches submitted while others run share the engine
        (continuous batching); a weight update in between says what happens to them (``mode``
        of ``refit``/``update_weights``). ``replica``: the data-parallel replica to prefer
        while it has room (one that holds the prompts' prefix; ``SampleResult.replica`` says
        where a sample ran); None: the least loaded."""
        self.require(Capability.ASYNC, "submit (streamed rollouts)")
        replicas = max(1, len(self.replica_load()))
        if replica is not None and (
            isinstance(replica, bool) or not isinstance(replica, int) or not 0 <= replica < replicas
        ):
            raise InputError(f"submit(replica={replica!r}): a replica is an int in [0, {replicas}) or None")
        batch, params = self._prepare(data, greedy)
        rollout = Rollout(self._streams, batch, self.cfg["pad_token_id"], tag)
        self.updates.prefixes_cached = True
        self._streams.submit(rollout, unpad(batch["input_ids"], batch["input_lengths"]), params, replica)
        return rollout

    def replica_load(self) -> list[ReplicaLoad]:
        """Each data-parallel replica's streamed samples (running, capacity, started so far),
        in replica order; empty where the backend runs one engine that places nothing."""
        return []

    def _stream_stop_reason(self, params: SampleParams, end: int, tokens: list[int]) -> str:
        return stop_reason(
            tokens,
            end,
            params,
            self.model_info.eos_token_ids,
            self.max_model_len,
            lambda generated: self._hits_stop_string(params, generated),
        )

    def _stream_start(self, requests: list[SampleRequest]) -> None:
        """Start generating ``requests`` and report each one's end to ``self._streams.deliver``
        (from any thread); backends that declare ``async`` implement it."""
        raise UnsupportedCapability(self.name, Capability.ASYNC.value, "streamed rollouts")

    def _stream_abort(self, keys: list[str]) -> None:
        """End the samples ``keys`` now: report each (``aborted=True``, with the tokens it has)
        unless it ended already."""
        raise UnsupportedCapability(self.name, Capability.ASYNC.value, "streamed rollouts")

    def sample_params(self, batch: Mapping[str, Any], greedy: bool) -> list[SampleParams]:
        """Per-sample settings for a validated batch, as ``generate`` resolves them (the config's,
        the batch's per-sample values, the context's limit on each budget)."""
        return resolve_sampling(self.cfg, batch, greedy, self.max_model_len, self.model_info.eos_token_ids)

    @abstractmethod
    def _generate(self, batch: BatchedDataDict[Any], params: list[SampleParams]) -> BatchedDataDict[Any]:
        """Generate for a validated, non-empty batch, each sample by its settings ``params``;
        return GenerationOutputSpec."""

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.cfg["model_name"])
        return self._tokenizer

    def generate_text(self, data: Mapping[str, Any], greedy: bool = False) -> BatchedDataDict[Any]:
        self._check_open()
        self.require(Capability.TEXT, "generate_text")
        prompts = data.get("prompts") if isinstance(data, Mapping) else None
        if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
            raise InputError('generate_text takes {"prompts": [str, ...]}')
        if not prompts:
            return BatchedDataDict({"texts": []})
        encoded = [self.tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
        empty = [i for i, e in enumerate(encoded) if not e]
        if empty:
            raise InputError(f"sample(s) {empty}: prompt encodes to no tokens", empty)
        ids, lengths = right_pad(encoded, self.cfg["pad_token_id"], torch.long)
        batch: dict[str, Any] = {"input_ids": ids, "input_lengths": lengths}
        if data.get("stop_strings") is not None:
            batch["stop_strings"] = data["stop_strings"]
        out = self.generate(batch, greedy=greedy)
        starts, ends = lengths.tolist(), out["unpadded_sequence_lengths"].tolist()
        rows = out["output_ids"].tolist()
        texts = self.tokenizer.batch_decode(
            [r[s:e] for r, s, e in zip(rows, starts, ends)], skip_special_tokens=True
        )
        stops = data.get("stop_strings") or [None] * len(prompts)
        base = tuple(self.cfg.get("stop_strings") or ())
        texts = [truncate_at_stop(t, base + tuple(s or ())) for t, s in zip(texts, stops)]
        return BatchedDataDict({"texts": texts})

    # ---- sleep / wake -------------------------------------------------------------------------
    @serialised
    def prepare_for_generation(self, tags: Sequence[str] | None = None) -> None:
        self._check_open()
        self.require(Capability.SLEEP_WAKE, "prepare_for_generation (wake)")
        wanted = list(WAKE_TAGS if tags is None else tags)
        unknown = [t for t in wanted if t not in WAKE_TAGS]
        if unknown:
            raise InputError(f"unknown wake tags {unknown}; use {list(WAKE_TAGS)}")
        todo = [t for t in WAKE_TAGS if t in wanted and t not in self._awake]
        if todo:
            self._wake(todo)
            self._awake.update(todo)

    @serialised
    def finish_generation(self) -> None:
        self._check_open()
        self._check_idle("sleep (finish_generation)")
        self.require(Capability.SLEEP_WAKE, "finish_generation (sleep)")
        if self._awake:
            self._sleep()
            self._awake.clear()
            self.updates.prefixes_cached = False

    def _wake(self, tags: list[str]) -> None:  # noqa: B027 - optional hook, a no-op unless the engine needs it
        """Bring ``tags`` back onto the device."""

    def _sleep(self) -> None:  # noqa: B027 - optional hook, a no-op unless the engine needs it
        """Reset the prefix cache and release memory."""

    # ---- refit --------------------------------------------------------------------------------
    # The public methods check the call and the engine's state, then hand the update to
    # ``updates`` (``rollgen.refit.WeightUpdates``), which reaches the engine through its link.
    @functools.cached_property
    def updates(self) -> WeightUpdates:
        """This generation's weight updates: their state and their lifecycle."""
        return WeightUpdates(self.name, self._refit_link(), lambda: self.weight_spec, self._streams)

    def _refit_link(self) -> EngineLink:
        """How updates reach the engine: by default in this process, through ``_apply_bucket``
        and the other hooks (backends whose engines live elsewhere give their own)."""
        return InProcessLink(self)

    @property
    def weight_spec(self) -> WeightSpec:
        """What a refit may send: HF checkpoint names, full (unsharded) shapes, engine dtype."""
        if self._weight_spec is None:
            self._weight_spec = self._expected_weights()
        return self._weight_spec

    def _expected_weights(self) -> WeightSpec:
        """The HF model's state dict (built on the meta device); backends that hold the model
        may read their own."""
        return self.model_info.weight_spec(self.engine_dtype)

    @property
    def engine_dtype(self) -> torch.dtype:
        """The dtype the engine holds weights in."""
        return resolve_dtype(self.cfg.get("dtype", "auto"), self.model_info)

    def check_weights(self, metas: Iterable[TensorMeta], partial: bool = False) -> None:
        """RefitError (listing every problem) unless the tensors match the served model and
        cover all of it (``partial``: whole module groups of it)."""
        self.updates.check(metas, partial)

    def _run_update(
        self,
        apply: Callable[[], None],
        *,
        buckets: list[WeightBucket] | None = None,
        source: torch.nn.Module | Mapping[str, torch.Tensor] | None = None,
        dtype: torch.dtype | None = None,
        partial: bool = False,
    ) -> None:
        """Run one validated call's weight update (``apply``): of ``buckets``, of ``source`` cast
        to ``dtype``, or (neither) over the weight-sync group. Backends whose engines can be
        replaced run it again after a death and keep what it applied."""
        apply()

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
    ) -> None:
        """Apply buckets packed by ``rollgen.iter_buckets`` (in this or another process; checked
        there for NaN and infinite values). Names, shapes and dtypes are checked first, and that
        they cover the whole model (``partial=True``: whole module groups of it). ``mode``: what
        happens to streamed samples in flight (``rollgen.rollout.UpdateMode``)."""
        self._check_open()
        self._check_awake(["weights"], "update weights")
        if buckets is None or isinstance(buckets, (str, bytes, Mapping, torch.Tensor)):
            raise RefitError(f"update_weights takes a WeightBucket or several, got {type(buckets).__name__}")
        items = [buckets] if isinstance(buckets, WeightBucket) else list(buckets)
        for b in items:
            if not isinstance(b, WeightBucket):
                raise RefitError(f"update_weights takes WeightBucket(s), got {type(b).__name__}")
            if b.transport not in TRANSPORT_CAPABILITY:
                raise RefitError(f"unknown refit transport {b.transport!r}")
            self.require(TRANSPORT_CAPABILITY[b.transport], f"refit over {b.transport}")
        self._run_update(
            lambda: self.updates.apply_buckets(items, partial, mode), buckets=items, partial=partial
        )

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
    ) -> None:
        """Push a local model or state dict into the engine: validate everything (names, shapes,
        dtypes, the whole model covered unless ``partial``, no NaN or infinite value unless
        ``check_finite`` is False), then stream bounded buckets over ``local_transport``
        (``bucket_bytes`` None: the size the first such refit took, a quarter of the free memory
        of the source's GPU then, 64 MiB to 4 GiB, or 1 GiB from host memory; over CUDA IPC into
        staging buffers kept between refits, ``release_refit_buffers``), or broadcast them over
        the weight-sync group when this process is its sender (``init_weight_sync(...,
        local_sender=True)``). ``dtype`` casts while packing. Over CUDA IPC, RefitError before
        anything is sent unless the source's GPU holds every engine GPU's handle. ``mode``: what
        happens to streamed samples in flight (``rollgen.rollout.UpdateMode``; validation comes
        first, so a rejected refit leaves them running)."""
        self._check_open()
        self._check_awake(["weights"], "refit")
        self.require(TRANSPORT_CAPABILITY[self.local_transport], "refit")
        self._run_update(
            lambda: self.updates.refit(
                source,
                bucket_bytes=bucket_bytes,
                dtype=dtype,
                partial=partial,
                check_finite=check_finite,
                mode=mode,
            ),
            source=source,
            dtype=dtype,
            partial=partial,
        )

    @serialised
    def release_refit_buffers(self) -> None:
        """Free the buffers ``refit`` keeps between refits (CUDA IPC staging buffers: one of
        the largest bucket on each engine GPU); the next refit makes new ones. A no-op where
        there are none."""
        self._check_idle("release the refit buffers")  # the engines' decoding threads own them
        self.updates.link.release()

    @property
    def engine_devices(self) -> tuple[str, ...]:
        """UUIDs of the GPUs the engine's ranks run on (empty on CPU, or where unknown)."""
        return ()

    # ---- weight-sync group ----------------------------------------------------------------------
    @property
    def weight_sync_ranks(self) -> int:
        """How many engine ranks join a weight-sync group (every TP rank of every replica)."""
        return 1

    @property
    def sync_device(self) -> torch.device:
        """Where the engine receives broadcast buckets (NCCL needs a GPU)."""
        return torch.device("cpu")

    def weight_sync_spec(
        self, address: str, port: int = 0, *, backend: SyncBackend | None = None, timeout_s: float = 600.0
    ) -> SyncGroupSpec:
        """The spec of a weight-sync group for these engines: the trainer's sending rank (rank
        0) hosts its TCP store at ``address:port`` (port 0: a free port, which the sender's
        ``spec`` then carries); every engine rank joins (``backend`` None: NCCL if the engines
        run on GPUs, else gloo). Give it to ``rollgen.WeightSender`` in the trainer's sending
        process, and the sender's ``spec`` to ``init_weight_sync`` here."""
        self.require(Capability.REFIT_COLLECTIVE, "a weight-sync group")
        if backend is None:
            backend = "nccl" if self.sync_device.type == "cuda" else "gloo"
        return SyncGroupSpec(address, port, 1 + self.weight_sync_ranks, backend, timeout_s)

    @serialised
    def init_weight_sync(self, spec: SyncGroupSpec, *, local_sender: bool = False) -> None:
        """Have every engine rank join the weight-sync group of ``spec`` while the trainer's
        sending process joins it (``sender = rollgen.WeightSender(spec)`` there, made from
        ``weight_sync_spec``; pass ``sender.spec`` here, which has the port it listens on, and
        call ``sender.connect()`` there); returns once all have joined. ``local_sender``: this
        process is the sender (``spec.port`` 0: a free port; the current CUDA device, over
        NCCL), and ``refit`` broadcasts. Then each ``WeightSender.send`` pairs with an
        ``update_weights_from_collective`` here. A new group replaces the last one (after a
        trainer restarts, or a failure broke the group)."""
        self._check_open()
        self.require(Capability.REFIT_COLLECTIVE, "init_weight_sync")
        self.updates.init_weight_sync(spec, local_sender)

    @serialised
    def update_weights_from_collective(self, *, mode: UpdateMode = "wait") -> None:
        """Receive the update the trainer's ``WeightSender.send`` broadcasts (call both at once:
        this returns when the update is applied). Checked against the served model before any
        byte is applied; a failure while applying marks the generation stale. Raised here at
        once, before the engines take part (the trainer's ``send`` then waits out its
        ``timeout_s``): a closed or sleeping engine, or no group."""
        self._check_open()
        self._check_awake(["weights"], "update weights")
        self._run_update(lambda: self.updates.update_from_collective(mode))

    # ---- engine hooks of a refit in process (``rollgen.refit.InProcessLink``) --------------------
    @abstractmethod
    def _apply_bucket(self, bucket: WeightBucket) -> None:
        """Load one validated bucket into the engine."""

    def _clear_kv_cache(self) -> None:  # noqa: B027 - optional hook, a no-op unless the engine needs it
        """Drop cached prefixes and zero the KV cache (after a generate returned NaN logprobs:
        the cache may hold NaNs from the weights that produced them)."""
        self._reset_prefix_cache()

    def _reset_prefix_cache(self) -> None:  # noqa: B027 - optional hook, a no-op unless the engine needs it
        """Invalidate cached prefixes (after a refit that follows a generate; ``_sleep`` resets
        them itself)."""

    # ---- shutdown -----------------------------------------------------------------------------
    #: Seconds ``shutdown`` waits for a call in progress before it shuts down without it (None:
    #: for ever). Engines in other processes, which shutdown kills, set it: the call then fails.
    shutdown_wait_s: ClassVar[float | None] = None

    def shutdown(self) -> None:
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
        if "updates" in self.__dict__:
            self.updates.close()
        self._streams.close(self.shutdown_grace_s)
        self._shutdown()

    def __enter__(self) -> BaseGeneration:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def _shutdown(self) -> None:  # noqa: B027 - optional hook, a no-op unless the engine needs it
        """Free the engine."""


def _within(value: float, low: float | None, high: float | None) -> bool:
    return (low is None or value >= low) and (high is None or value <= high)


def _bounds(low: float | None, high: float | None) -> str:
    return f"[{'-inf' if low is None else low}, {'inf' if high is None else high}]"


def resolve_dtype(name: str, info: ModelInfo) -> torch.dtype:
    """The torch dtype for a config ``dtype`` ("auto": the checkpoint's, else float32)."""
    if name == "auto":
        name = info.torch_dtype or "float32"
    return getattr(torch, name)
