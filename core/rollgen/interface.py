"""``GenerationInterface``: the whole surface a trainer and the conformance suite use. Every backend
implements it, usually through ``rollgen.BaseGeneration``."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import torch

from rollgen.data import BatchedDataDict
from rollgen.model_info import ModelInfo
from rollgen.refit import Transport, WeightBucket, WeightSpec
from rollgen.refit.adapters import RefitTarget
from rollgen.refit.transports.collective import SyncBackend, SyncGroupSpec
from rollgen.rollout import InFlightSample, ReplicaLoad, Rollout, UpdateMode
from rollgen.spec import Capability


@runtime_checkable
class GenerationInterface(Protocol):
    """A generation engine, as ``rollgen.create_generation`` returns it."""

    #: The config as validated, every default filled in.
    cfg: dict[str, Any]
    #: What rollgen read from the model folder (vocabulary, context length, EOS ids, ...).
    model_info: ModelInfo
    #: The longest prompt plus generation the engine takes (prompts must leave one token).
    max_model_len: int
    #: The transport ``refit()`` packs a local source with (``iter_buckets`` elsewhere).
    local_transport: Transport
    #: How long ``shutdown`` waits for the engine to report the streamed samples it aborts.
    shutdown_grace_s: float

    @property
    def name(self) -> str:
        """The backend's name (``"vllm"``, ``"hf"``, ...)."""

    @property
    def capabilities(self) -> frozenset[Capability]: ...

    @property
    def engine_dtype(self) -> torch.dtype:
        """The dtype the engine holds weights in (what a refit must send, or cast to)."""

    @property
    def weight_spec(self) -> WeightSpec:
        """What a refit may send: HF checkpoint names, full (unsharded) shapes, engine dtype."""

    @property
    def releases_memory_on_sleep(self) -> bool:
        """Whether ``finish_generation`` really frees device memory (False: an honest no-op)."""

    @property
    def usable(self) -> bool:
        """False once shut down or once an engine worker died (create a new generation)."""

    @property
    def ready(self) -> bool:
        """Whether it can generate now: usable, awake, its weights not stale."""

    def wait_ready(self, timeout_s: float | None = None) -> bool:
        """Block until ``ready`` (or until it can never be), at most ``timeout_s``; returns ``ready``."""

    @property
    def weight_version(self) -> int:
        """How many weight updates have completed (streamed tokens are stamped with it)."""

    def generate(self, data: Mapping[str, Any], greedy: bool = False) -> BatchedDataDict[Any]:
        """Right-padded ``input_ids``/``input_lengths`` in; GenerationOutputSpec out."""

    def submit(
        self,
        data: Mapping[str, Any],
        greedy: bool = False,
        *,
        tag: Any = None,
        replica: int | None = None,
        stream_tokens: bool = False,
    ) -> Rollout:
        """``generate``'s input in; returns at once a ``Rollout`` that yields each sample as it
        finishes, each result carrying ``tag`` (capability ``async``); ``replica``: the
        data-parallel replica to prefer while it has room; ``stream_tokens``: each sample's
        tokens also as they are made (``Rollout.events``)."""

    def replica_load(self) -> list[ReplicaLoad]:
        """Each data-parallel replica's streamed samples (empty for a backend of one engine)."""

    def samples_in_flight(self) -> list[InFlightSample]:
        """The streamed samples not yet reported, and for how long each has run."""

    def generate_text(self, data: Mapping[str, Any], greedy: bool = False) -> BatchedDataDict[Any]:
        """``{"prompts": [str], "stop_strings"?: [...]}`` in; ``{"texts": [str]}`` out."""

    def prepare_for_generation(self, tags: Sequence[str] | None = None) -> None:
        """Wake (all of it, or only ``tags`` such as ``["weights"]`` then ``["kv_cache"]``)."""

    def finish_generation(self) -> None:
        """Sleep: reset the prefix cache and release memory where the backend can."""

    def update_weights(
        self,
        buckets: WeightBucket | Iterable[WeightBucket],
        *,
        partial: bool = False,
        mode: UpdateMode = "wait",
        target: RefitTarget = "weights",
    ) -> None:
        """Apply packed weight buckets (validated first; RefitError leaves old weights), or
        (``target="adapter"``) one adapter bucket."""

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
        """Push a local model or state dict into the engine (validated, bucketed), or
        (``target="adapter"``) a LoRA adapter as a new adapter version. ``mode``: what happens to
        streamed samples in flight."""

    def release_refit_buffers(self) -> None:
        """Free the buffers ``refit`` keeps between refits (CUDA IPC staging buffers)."""

    def weight_sync_spec(
        self, address: str, port: int = 0, *, backend: SyncBackend | None = None, timeout_s: float = 600.0
    ) -> SyncGroupSpec:
        """The spec of a weight-sync group for these engines (capability ``refit_collective``)."""

    def init_weight_sync(self, spec: SyncGroupSpec, *, local_sender: bool = False) -> None:
        """Have every engine rank join the weight-sync group of ``spec``."""

    def update_weights_from_collective(self, *, mode: UpdateMode = "wait") -> None:
        """Receive the update the trainer's ``WeightSender.send`` broadcasts."""

    def shutdown(self) -> None:
        """Release the engine. Idempotent."""

    def __enter__(self) -> GenerationInterface: ...

    def __exit__(self, *exc: object) -> None: ...
