"""``VllmWorker``: the Ray actor that owns one vLLM engine (the leader of a tied group)."""

from __future__ import annotations

import functools
import gc
import logging
import os
import pickle
from typing import Any

from rollgen.data import BatchedDataDict
from rollgen.distributed.worker_groups import TiedGroup
from rollgen.errors import RollgenError
from rollgen.output import assemble_from_lists
from rollgen.sampling import SampleParams

logger = logging.getLogger(__name__)


def engine_kwargs(cfg: dict[str, Any], use_gpus: bool, executor: str | None) -> dict[str, Any]:
    """``vllm.LLM``'s arguments for a resolved config (``vllm_kwargs`` last, overriding)."""
    vcfg = cfg["vllm_cfg"]
    tp = vcfg["tensor_parallel_size"]
    kwargs: dict[str, Any] = {
        "model": cfg["model_name"],
        "dtype": cfg["_engine_dtype"],
        "tensor_parallel_size": tp,
        "distributed_executor_backend": executor,
        "enforce_eager": vcfg["enforce_eager"],
        "max_model_len": cfg["_max_model_len"],
        "worker_extension_cls": "rollgen_vllm.extension.RollgenWorkerExtension",
        "enable_sleep_mode": bool(vcfg["enable_sleep_mode"]),
        "load_format": vcfg["load_format"],
        "seed": 0 if cfg["seed"] is None else int(cfg["seed"]),
        "generation_config": "vllm",
        "disable_log_stats": True,
        "logprobs_mode": "processed_logprobs" if cfg["logprobs_mode"] == "processed" else "raw_logprobs",
    }
    if use_gpus:
        kwargs["gpu_memory_utilization"] = vcfg["gpu_memory_utilization"]
    if use_gpus and tp > 1:
        # on Hopper, compiled TP engines fuse all-reduce with RMSNorm through FlashInfer's
        # NVLink-multicast ("mnnvl") all-reduce; with multicast off (as the lent H200s need)
        # the engine hung and died at start (docs/gpu-results.md, session 6)
        kwargs["compilation_config"] = {"pass_config": {"fuse_allreduce_rms": False}}
    if vcfg["kv_cache_memory_bytes"]:
        kwargs["kv_cache_memory_bytes"] = vcfg["kv_cache_memory_bytes"]
    kwargs.update(cfg.get("vllm_kwargs") or {})
    return kwargs


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


def sampling_params(samples: list[SampleParams]) -> list[Any]:
    """One ``vllm.SamplingParams`` per sample, asking for the sampled token's logprob (in vLLM's
    flat layout where this vLLM has it)."""
    import vllm

    extra = {"flat_logprobs": True} if flat_logprobs_supported() else {}
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


class VllmWorker:
    """Owns ``vllm.LLM``. TP > 1 on GPU: vLLM's Ray executor over the group's bundles; on CPU
    (no Ray executor there): vLLM's ``mp`` executor inside this actor."""

    def __init__(self, cfg: dict[str, Any], use_gpus: bool, group: TiedGroup, index: int) -> None:
        import ray

        self.cfg, self.index = cfg, index
        vcfg = cfg["vllm_cfg"]
        tp = self.tp = vcfg["tensor_parallel_size"]
        os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
        if vcfg["in_process"]:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        # engine-core processes must join this cluster, not start their own
        os.environ["RAY_ADDRESS"] = ray.get_runtime_context().gcs_address
        if use_gpus and tp > 1:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
            os.environ["VLLM_RAY_PER_WORKER_GPUS"] = str(1.0 / tp)
            os.environ["VLLM_RAY_BUNDLE_INDICES"] = ",".join(map(str, group.bundle_indices))
            executor: str | None = "ray"
        else:
            executor = "mp" if tp > 1 else None
        if not use_gpus:
            os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")
            if tp > 1:
                cores = os.cpu_count() or 1
                os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(
                    str((index * tp + r) % cores) for r in range(tp)
                )
        import vllm

        self.sleep_enabled = bool(vcfg["enable_sleep_mode"])
        self.llm = vllm.LLM(**engine_kwargs(cfg, use_gpus, executor))
        self.flat_logprobs = flat_logprobs_supported()

    def ready(self) -> dict[str, Any]:
        import vllm

        return {"vllm": vllm.__version__, "flat_logprobs": self.flat_logprobs}

    def generate(self, shard: BatchedDataDict[Any]) -> BatchedDataDict[Any]:
        """Generate for one data-parallel shard; output in the contract's layout."""
        ids, lengths = shard["input_ids"], shard["input_lengths"]
        prompts = [{"prompt_token_ids": row[:n].tolist()} for row, n in zip(ids, lengths.tolist())]
        params = sampling_params(shard["_params"])
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        tokens = [list(o.outputs[0].token_ids) for o in outputs]
        logprobs = [self._logprobs(o.outputs[0]) for o in outputs]
        return assemble_from_lists(ids, lengths, tokens, logprobs, self.cfg["pad_token_id"])

    def _logprobs(self, completion: Any) -> list[float]:
        lps = completion.logprobs
        if lps is None:
            raise RollgenError("vLLM returned no logprobs although logprobs=0 was requested")
        if self.flat_logprobs:
            return list(lps.logprobs)
        return [pos[t].logprob for pos, t in zip(lps, completion.token_ids)]

    def apply_bucket(self, data: bytes) -> list[dict[str, Any]]:
        """Load a pickled WeightBucket into every TP rank (one pickle per rank: shared-memory
        handles open once each); each rank's tensor count and seconds mapping and loading."""
        bucket = pickle.loads(data).resolve()
        per_rank = [pickle.dumps(bucket) for _ in range(self.tp)]
        replay = self.cfg["vllm_cfg"]["replay_refit"]
        return self.llm.collective_rpc("rollgen_load_bucket", args=(per_rank, replay))

    def device_uuids(self) -> list[str]:
        return self.llm.collective_rpc("rollgen_device_uuid")

    def reset_prefix_cache(self) -> None:
        self.llm.reset_prefix_cache()

    def sleep(self) -> None:
        # vLLM's workers free their own memory; this actor holds none of it
        self.llm.reset_prefix_cache()
        if self.sleep_enabled:
            self.llm.sleep(level=1)

    def wake(self, tags: list[str]) -> None:
        if self.sleep_enabled:
            self.llm.wake_up(tags=tags)

    def shutdown(self) -> None:
        llm, self.llm = getattr(self, "llm", None), None
        engine = getattr(llm, "llm_engine", None)
        if engine is not None and hasattr(engine, "engine_core"):
            engine.engine_core.shutdown()
        del llm
        gc.collect()
