"""Worker extension loaded into every vLLM worker (``worker_extension_cls``).

A ``vllm_kwargs["worker_extension_cls"]`` of your own must subclass ``RollgenWorkerExtension``;
its methods are then reachable through ``VllmGeneration.collective_rpc``. A subclass may wrap
``rollgen_unpack`` and ``rollgen_load`` (the two steps of a refit on each rank, over the RPC
and over the rank's refit channel alike).

Adapter versions are written from the refit's tensors straight into vLLM's LoRA slots
(``rollgen_vllm.lora_slots``: no folder on disk, no LoRA built on the host), so a request naming the
version's ``lora_int_id`` finds it loaded and vLLM never reads its path."""

from __future__ import annotations

import functools
import importlib
import logging
import pickle
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, cast

import torch

from rollgen.errors import ConfigError, RefitError
from rollgen.refit import Named, Receiver, WeightSpec, device_uuid
from rollgen.refit.adapters import no_lora
from rollgen.refit.channel import ChannelServer, DropAdapter, LoadAdapter
from rollgen.refit.checks import nonfinite
from rollgen.refit.transports.collective import SyncGroup, SyncGroupSpec, receive
from rollgen_vllm import logs
from rollgen_vllm.load_plan import LoadPlans, LoadWay, bound_parameters
from rollgen_vllm.lora_slots import LoraSlots
from rollgen_vllm.quant_plan import QuantRecorder, Scratch
from rollgen_vllm.rpc_errors import returns_errors

logger = logging.getLogger(__name__)

#: ``vllm.LLM``'s ``worker_extension_cls`` for rollgen's engines.
EXTENSION = f"{__name__}.RollgenWorkerExtension"


class RollgenWorkerExtension:
    """Methods reached through ``LLM.collective_rpc``; ``self`` is a vLLM worker."""

    @returns_errors
    def rollgen_load_bucket(self, layout: str, per_rank: list[bytes], replay: bool) -> None:
        """Load one pickled bucket of HF-named full tensors (``per_rank[rank]``) of ``layout``
        (``refit.Receiver.unpack``); each rank keeps its own shard."""
        self.rollgen_load_request(layout, per_rank[self.rollgen_rank], replay)

    def rollgen_load_request(self, layout: str, data: bytes | None, replay: bool) -> bool:
        """Load this rank's bucket sent as ``(layout, data)``: its pickle, or (over this rank's
        refit channel) None for a kept layout; False, having loaded nothing: the layout is not
        held here."""
        start = time.perf_counter()
        unpacked = self.rollgen_unpack(layout, data)
        if unpacked is None:
            return False
        named, kept = unpacked
        mapped = time.perf_counter()
        way = self.rollgen_load(named, replay, kept)
        logger.debug(
            "rank %d: %d tensors mapped in %.2f ms, %s in %.2f ms",
            self.rollgen_rank,
            len(named),
            (mapped - start) * 1e3,
            way,
            (time.perf_counter() - mapped) * 1e3,
        )
        return True

    def rollgen_open_channel(
        self, authkey: bytes, replay: bool, owner: int, capacity: int, setup: dict[str, Any] | None = None
    ) -> str:
        """Open this rank's refit channel (``rollgen.refit.channel``), which answers each
        request between two of the engine's steps (``rollgen_answer``), while the processes up
        to ``owner`` (the pid of the engine's actor) run, keeping ``capacity`` layouts (as the
        driver's mirror of them does); ``setup``: the adapters' PEFT setup (None: the engine
        has no LoRA); its address."""
        self.rollgen_receiver = Receiver(self.rollgen_device(), capacity)
        steps = self.rollgen_steps
        self.rollgen_channel = ChannelServer(
            lambda request: self.rollgen_answer(request, replay, setup, steps),
            authkey,
            self.rollgen_device(),
            owner,
        )
        return self.rollgen_channel.address

    @property
    def rollgen_steps(self) -> threading.Lock:
        """A lock this worker's steps hold (its model runner's ``execute_model`` and
        ``sample_tokens``, which every executor of vLLM's calls, wrapped on first use): what
        runs under it falls between two steps. An adapter version is written while samples of
        other versions decode, and a step reads vLLM's LoRA bookkeeping."""
        lock: threading.Lock | None = getattr(self, "_rollgen_steps", None)
        if lock is None:
            lock = self._rollgen_steps = threading.Lock()
            runner = self.model_runner
            for name in STEP_METHODS:
                if (step := getattr(runner, name, None)) is not None:
                    setattr(runner, name, _holding(lock, step))
        return lock

    def rollgen_answer(
        self, request: Any, replay: bool, setup: dict[str, Any] | None, steps: threading.Lock
    ) -> bool | None:
        """What this rank's refit channel answers ``request`` with, taken between two steps
        (``steps``): a bucket loaded (``LoadBucket``: whether its layout was held), an adapter
        version held or freed (``LoadAdapter``, ``DropAdapter``)."""
        if isinstance(request, (LoadAdapter, DropAdapter)) and setup is None:
            raise no_lora(f"rank {self.rollgen_rank}")
        with steps:
            if isinstance(request, DropAdapter):
                self.rollgen_drop_adapter(request.version)
                return None
            if isinstance(request, LoadAdapter):
                for old in request.drop:
                    self.rollgen_drop_adapter(old)
                self.rollgen_take_adapter(
                    request.version, request.data, cast(dict[str, Any], setup), request.layout
                )
                return None
            layout, data = request
            return self.rollgen_load_request(layout, data, replay)

    @property
    def rollgen_receiver(self) -> Receiver:
        """This rank's end of refits: its unpacking, and the layouts it keeps."""
        receiver: Receiver | None = getattr(self, "_rollgen_receiver", None)
        if receiver is None:
            receiver = self._rollgen_receiver = Receiver(self.rollgen_device())
        return receiver

    @rollgen_receiver.setter
    def rollgen_receiver(self, receiver: Receiver) -> None:
        self._rollgen_receiver = receiver

    @property
    def rollgen_adapter_receiver(self) -> Receiver:
        """This rank's end of adapter refits: the adapters' staging layout it keeps (one; apart
        from the weights' layouts, which the driver mirrors)."""
        receiver: Receiver | None = getattr(self, "_rollgen_adapter_receiver", None)
        if receiver is None:
            receiver = self._rollgen_adapter_receiver = Receiver(self.rollgen_device(), capacity=1)
        return receiver

    @property
    def rollgen_rank(self) -> int:
        return int(getattr(self, "rank", 0))

    @property
    def rollgen_adapters(self) -> dict[int, tuple[list[tuple[str, torch.Tensor]], dict[str, Any]]]:
        """Copies of the adapter versions this rank holds, with their PEFT setup, where a refit
        of the weights reloads them (``rollgen_reloads``: vLLM 0.32 forgets its LoRAs then, and
        they are written again); empty elsewhere (the slots are the only copy)."""
        held: dict[int, tuple[list[tuple[str, torch.Tensor]], dict[str, Any]]] | None = getattr(
            self, "_rollgen_adapters", None
        )
        if held is None:
            held = self._rollgen_adapters = {}
        return held

    @property
    def rollgen_lora_slots(self) -> LoraSlots:
        """This rank's writer of adapter versions into vLLM's LoRA slots."""
        slots: LoraSlots | None = getattr(self, "_rollgen_lora_slots", None)
        if slots is None:
            slots = self._rollgen_lora_slots = LoraSlots(self.model_runner.lora_manager)
        return slots

    @returns_errors
    def rollgen_load_adapter(self, version: int, per_rank: list[bytes], setup: dict[str, Any]) -> None:
        """Hold the pickled adapter bucket ``per_rank[rank]`` (PEFT's names) of PEFT setup
        ``setup`` (``r``, ``lora_alpha``, ``target_modules``) as the LoRA whose ``lora_int_id`` is
        ``version`` (loaded again: replaced)."""
        self.rollgen_take_adapter(version, per_rank[self.rollgen_rank], setup)

    def rollgen_take_adapter(
        self, version: int, data: bytes, setup: dict[str, Any], layout: str = ""
    ) -> None:
        """Hold the pickled adapter bucket ``data`` as adapter ``version`` (over the RPC, or
        this rank's refit channel; a kept ``layout``'s tensors unpacked once)."""
        named = cast(tuple[Named, bool], self.rollgen_adapter_receiver.unpack(layout, data))[0]
        try:
            self.rollgen_write_adapter(version, named, setup)
            if self.rollgen_reloads:  # the bucket's memory is the sender's
                self.rollgen_adapters[version] = ([(n, t.clone()) for n, t in named], setup)
        finally:
            if torch.cuda.is_available():
                torch.cuda.synchronize()  # the sender reuses or frees the bucket once this returns

    def rollgen_drop_adapter(self, version: int) -> None:
        """Free the LoRA of adapter ``version``."""
        self.rollgen_adapters.pop(version, None)
        self.model_runner.lora_manager.remove_adapter(version)

    def rollgen_write_adapter(
        self, version: int, named: list[tuple[str, torch.Tensor]], setup: dict[str, Any]
    ) -> None:
        """Hold ``named`` as adapter ``version`` in a LoRA slot (``LoraSlots.write``)."""
        self.rollgen_lora_slots.write(version, named, setup)

    @returns_errors
    def rollgen_join_weight_sync(self, spec: bytes, first_rank: int) -> None:
        """Join the weight-sync group of the pickled ``SyncGroupSpec`` as rank ``first_rank`` +
        this worker's rank."""
        group: SyncGroupSpec = pickle.loads(spec)
        self.rollgen_sync = SyncGroup(group, first_rank + self.rollgen_rank, self.rollgen_device())

    @returns_errors
    def rollgen_receive_weights(self, spec: bytes, replay: bool) -> bool:
        """Receive one update over the weight-sync group (``collective.receive``), checked
        against the pickled ``WeightSpec``."""
        weights: WeightSpec = pickle.loads(spec)
        return receive(self.rollgen_sync, weights, lambda named: self.rollgen_load(named, replay))

    def rollgen_release_staged(self, keys: list[str]) -> None:
        """Unmap the trainer's staging buffers ``keys`` (``rollgen.refit.staging``)."""
        for plans in ("rollgen_load_plans", "rollgen_quant_plans"):
            if hasattr(self, plans):
                getattr(self, plans).forget_kept()
        self.rollgen_receiver.release(keys)
        self.rollgen_adapter_receiver.release(keys)

    def rollgen_device(self) -> torch.device:
        return self.device if torch.cuda.is_available() else torch.device("cpu")

    def rollgen_device_uuid(self) -> str:
        """This rank's GPU (CUDA IPC payloads are keyed by it)."""
        return device_uuid(self.device)

    def rollgen_clear_kv_cache(self) -> None:
        """Zero this rank's KV cache: after non-finite weights, cached keys and values stay NaN
        and leak into later attention (masked slots still multiply NaN by zero)."""
        for cache in getattr(self.model_runner, "kv_caches", None) or []:
            for tensor in cache if isinstance(cache, (list, tuple)) else [cache]:
                tensor.zero_()

    def rollgen_unpack(
        self, layout: str, data: bytes | None
    ) -> tuple[list[tuple[str, torch.Tensor]], bool] | None:
        """This rank's bucket as named tensors (CUDA IPC: mapped on this worker's GPU), and
        whether they are kept (a kept layout's: ``refit.Receiver.unpack``); None: ``data`` is
        None and the layout is not held here."""
        return self.rollgen_receiver.unpack(layout, data)

    def rollgen_load(
        self, named: list[tuple[str, torch.Tensor]], replay: bool, kept: bool = False
    ) -> LoadWay:
        """Copy ``named`` into the live parameters (each rank its shard); how it was loaded.
        ``kept``: the same list comes again with the next refit's values (its plan's sources
        are kept). A quantized engine, and any engine on CPU, reloads instead
        (``rollgen_reload``); one quantized as ``REPLAYED_QUANTIZATIONS`` replays its reloads
        (``quant_plan``) where ``replay``."""
        model = self.model_runner.model
        if not hasattr(self, "rollgen_lora_layers"):  # the modules are fixed once the engine is up
            self.rollgen_lora_layers = lora_layers(model)
        way: LoadWay = "loaded"
        if self.rollgen_reloads:
            if replay and self.rollgen_quantization in REPLAYED_QUANTIZATIONS:
                if not hasattr(self, "rollgen_quant_plans"):
                    recorder = functools.partial(QuantRecorder, scratch=Scratch())
                    self.rollgen_quant_plans = LoadPlans(bound_parameters(model, buffers=True), recorder)
                way = self.rollgen_quant_plans.load(named, self.rollgen_reload, kept)
                if way == "replayed":  # the reload checks its own
                    check_scales(self.rollgen_scaled)
            else:
                self.rollgen_reload(named)
            if torch.cuda.is_available():
                torch.cuda.synchronize()  # the sender reuses or frees the bucket once this returns
            return way
        with lora_unwrapped(self.rollgen_lora_layers):
            if not replay:
                model.load_weights(weights=named)
            else:
                if not hasattr(self, "rollgen_load_plans"):
                    self.rollgen_load_plans = LoadPlans(bound_parameters(model))
                way = self.rollgen_load_plans.load(named, lambda w: model.load_weights(weights=w), kept)
        torch.cuda.synchronize()  # the sender reuses or frees the bucket once this returns
        return way

    @property
    def rollgen_quantization(self) -> str | None:
        """The quantization this engine serves its weights in (vLLM's own model config, e.g.
        ``"fp8_per_block"`` from ``vllm_kwargs``); None: the checkpoint's dtype."""
        quantization = getattr(self.vllm_config.model_config, "quantization", None)
        return None if quantization is None else str(quantization)

    @property
    def rollgen_reloads(self) -> bool:
        """Whether refits go through vLLM's layerwise reload: on CPU (vLLM-CPU prepacks linear
        weights, which plain ``load_weights`` cannot write into) and for a quantized engine (its
        parameters are the quantized kernel tensors, not the checkpoint's)."""
        return not torch.cuda.is_available() or self.rollgen_quantization is not None

    def rollgen_reload(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """Load ``named``, in the checkpoint's format and dtype, through vLLM's layerwise reload:
        each layer all of whose tensors arrived is rebuilt from them and processed again
        (repacked, quantized) into its kernel tensors in place (CUDA graphs stay valid); the
        reload walks the whole model on every call. A quantized engine's scales are then
        checked (``check_scales``). LoRAs the reload dropped (vLLM 0.32 drops them all; 0.26
        keeps them) are added again."""
        logs.quiet()
        with lora_unwrapped(self.rollgen_lora_layers):
            self.reload_weights(weights_iterator=iter(named), is_checkpoint_format=True)
        if self.rollgen_quantization is not None:
            if not hasattr(self, "rollgen_scaled"):
                self.rollgen_scaled = scaled_modules(self.model_runner.model)
            check_scales(self.rollgen_scaled)
        if self.rollgen_adapters:
            kept = self.model_runner.lora_manager.list_adapters()
            for version, (named, setup) in self.rollgen_adapters.items():
                if version not in kept:
                    self.rollgen_write_adapter(version, named, setup)


#: The quantizations whose reloads are recorded and replayed (``quant_plan``): vLLM's online FP8
#: per tensor. Others reload every time: per block, the reload finds its scales with torch
#: operations, which a recording does not follow.
REPLAYED_QUANTIZATIONS = ("fp8_per_tensor",)

#: A vLLM model runner's methods that run a step (``sample_tokens``: vLLM 0.26 on, after
#: ``execute_model``).
STEP_METHODS = ("execute_model", "sample_tokens")


def _holding(lock: threading.Lock, step: Callable[..., Any]) -> Callable[..., Any]:
    """``step``, run holding ``lock``."""

    @functools.wraps(step)
    def locked(*args: Any, **kwargs: Any) -> Any:
        with lock:
            return step(*args, **kwargs)

    return locked


#: Where vLLM's quantized linear layers keep their scales: ``weight_scale`` (FP8 per tensor or
#: channel), ``weight_scale_inv`` (FP8 per block), ``input_scale`` (static activation scales).
SCALE_NAMES = ("weight_scale", "weight_scale_inv", "input_scale")


def scaled_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The modules of ``model`` that hold quantization scales (``SCALE_NAMES``), by name."""
    return [
        (name, module)
        for name, module in model.named_modules()
        if any(isinstance(getattr(module, s, None), torch.Tensor) for s in SCALE_NAMES)
    ]


def check_scales(modules: list[tuple[str, torch.nn.Module]]) -> None:
    """``RefitError`` naming each scale of ``modules`` (as held now) that is not all finite
    (``rollgen.refit.checks.nonfinite``: one host sync)."""
    bad = nonfinite(
        (f"{name}.{s}", t)
        for name, module in modules
        for s in SCALE_NAMES
        if isinstance(t := getattr(module, s, None), torch.Tensor)
    )
    if bad:
        raise RefitError(
            f"the engine's quantization of the update gave {len(bad)} non-finite scale(s); the "
            "engine holds the update in part: refit complete, finite weights (check_finite=True)",
            bad,
            stale=True,
        )


def check_extension(path: str) -> None:
    """ConfigError unless the ``worker_extension_cls`` at ``path`` ("module.Class") is rollgen's
    or a subclass of it (rollgen's refit runs through its methods)."""
    module, _, name = path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ConfigError(f"vllm_kwargs.worker_extension_cls {path!r} cannot be imported: {exc}") from None
    if not (isinstance(cls, type) and issubclass(cls, RollgenWorkerExtension)):
        raise ConfigError(f"vllm_kwargs.worker_extension_cls {path!r} must subclass {EXTENSION}")


#: A LoRA layer of vLLM's: the module holding it, its name there, the layer.
LoraLayer = tuple[torch.nn.Module, str, torch.nn.Module]


def lora_layers(model: torch.nn.Module) -> list[LoraLayer]:
    """vLLM's LoRA layers in ``model`` (each holds the layer it wraps as ``base_layer``)."""
    return [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if isinstance(getattr(child, "base_layer", None), torch.nn.Module)
    ]


@contextmanager
def lora_unwrapped(layers: list[LoraLayer]) -> Iterator[None]:
    """Each LoRA layer of ``layers`` replaced by the layer it wraps, then put back. Its
    parameters sit one level below where a model's ``load_weights`` looks for them, so loading
    weights into an engine started with LoRA fails without this (vLLM #39934); they are the
    same tensors either way."""
    swapped: list[LoraLayer] = []
    try:
        for parent, name, child in layers:
            setattr(parent, name, child.base_layer)
            swapped.append((parent, name, child))
        yield
    finally:
        for parent, name, child in swapped:
            setattr(parent, name, child)
