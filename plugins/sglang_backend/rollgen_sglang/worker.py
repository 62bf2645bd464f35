"""``SglangWorker``: the Ray actor that owns one ``sglang.Engine`` (the leader of a tied group)."""

from __future__ import annotations

import logging
import os
import pickle
from typing import Any

from rollgen.data import BatchedDataDict
from rollgen.distributed.worker_groups import TiedGroup
from rollgen.errors import InputError, RefitError
from rollgen.output import assemble_from_lists

logger = logging.getLogger(__name__)


def _bundle_gpu_ids(group: TiedGroup) -> list[str]:
    """Physical GPU ids of the tied group's bundles, asked of Ray by a tiny task in each."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    pg = ray.util.get_current_placement_group()

    @ray.remote(num_gpus=0.01, num_cpus=0)
    def gpu_id() -> str:
        return str(ray.get_gpu_ids()[0])

    return ray.get(
        [
            gpu_id.options(
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=b)
            ).remote()
            for b in group.bundle_indices
        ]
    )


class SglangWorker:
    """Owns ``sglang.Engine``; TP > 1 runs SGLang's own TP processes on the group's GPUs."""

    def __init__(self, cfg: dict[str, Any], use_gpus: bool, group: TiedGroup, index: int) -> None:
        self.cfg = cfg
        scfg = cfg["sglang_cfg"]
        tp = scfg["tensor_parallel_size"]
        if tp > 1:
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(_bundle_gpu_ids(group))
        if cfg["logprobs_mode"] == "raw":
            # SGLang returns the sampled (tempered) distribution's logprobs unless told otherwise
            os.environ["SGLANG_RETURN_ORIGINAL_LOGPROB"] = "1"
        os.environ.setdefault("SGLANG_OPT_USE_CUSTOM_ALL_REDUCE_V2", "0")  # no NVLink multicast
        import sglang

        self.sleep_enabled = bool(scfg["enable_sleep_mode"])
        deterministic = scfg["deterministic_inference"]
        self.seeded = cfg["seed"] is not None if deterministic is None else bool(deterministic)
        kwargs: dict[str, Any] = {
            "model_path": cfg["model_name"],
            "dtype": cfg["_engine_dtype"],
            "tp_size": tp,
            "mem_fraction_static": scfg["mem_fraction_static"],
            "enable_memory_saver": self.sleep_enabled,
            "enable_weights_cpu_backup": scfg["enable_weights_cpu_backup"] and self.sleep_enabled,
            "disable_cuda_graph": scfg["disable_cuda_graph"],
            "load_format": scfg["load_format"],
            "context_length": cfg["_max_model_len"],
            "random_seed": 0 if cfg["seed"] is None else int(cfg["seed"]),
            "log_level": scfg["log_level"],
            "enable_deterministic_inference": self.seeded,
            "sleep_on_idle": scfg["sleep_on_idle"],
        }
        if tp > 1:
            kwargs["enforce_disable_flashinfer_allreduce_fusion"] = True
        if cfg["_engine_dtype"] == "float32":
            kwargs["attention_backend"] = "triton"  # FA3 (Hopper's default) takes half precision only
        kwargs.update(cfg.get("sglang_kwargs") or {})
        self.engine = sglang.Engine(**kwargs)
        self.version = sglang.__version__

    def ready(self) -> dict[str, Any]:
        return {"sglang": self.version}

    def generate(self, shard: BatchedDataDict[Any]) -> BatchedDataDict[Any]:
        ids, lengths = shard["input_ids"], shard["input_lengths"]
        prompts = [row[:n].tolist() for row, n in zip(ids, lengths.tolist())]
        params = []
        for p in shard["_params"]:
            sp: dict[str, Any] = {
                "temperature": p.temperature,
                "top_p": p.top_p,
                "top_k": p.top_k if p.top_k > 0 else -1,
                "max_new_tokens": p.max_new_tokens,
                "stop": list(p.stop_strings) or None,
                "stop_token_ids": list(p.stop_token_ids) or None,
                "no_stop_trim": True,
            }
            if p.seed is not None:
                if not self.seeded:
                    raise InputError(
                        "SGLang ignores per-sample seeds without deterministic inference; "
                        "set sglang_cfg.deterministic_inference (or leave it None with a config seed)"
                    )
                sp["sampling_seed"] = p.seed
            params.append(sp)
        outputs = self.engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
        tokens = [list(o["output_ids"]) for o in outputs]
        logprobs = [[float(x[0]) for x in o["meta_info"]["output_token_logprobs"]] for o in outputs]
        return assemble_from_lists(ids, lengths, tokens, logprobs, self.cfg["pad_token_id"])

    def apply_bucket(self, data: bytes) -> None:
        """Rebuild the CUDA IPC tensors on this GPU and hand them to SGLang, which loads them into
        every TP rank (each keeps its shard). torch cannot pass on a tensor it received over IPC,
        so each is copied once on the device first (one bucket at a time, so bounded)."""
        bucket = pickle.loads(data).resolve()
        named = [(name, t.clone()) for name, t in bucket.unpack("cuda:0")]
        ok, message = self.engine.update_weights_from_tensor(named, flush_cache=False)
        if not ok:
            raise RefitError(f"SGLang did not load the bucket: {message}")

    def reset_prefix_cache(self) -> None:
        self.engine.flush_cache()

    def sleep(self) -> None:
        self.engine.flush_cache()
        if self.sleep_enabled:
            self.engine.release_memory_occupation()

    def wake(self, tags: list[str]) -> None:
        if self.sleep_enabled:
            # release_memory_occupation() also paused the CUDA graphs: they come back with the KV cache
            extra = ["cuda_graph"] if "kv_cache" in tags else []
            self.engine.resume_memory_occupation(tags=[*tags, *extra])

    def shutdown(self) -> None:
        engine, self.engine = getattr(self, "engine", None), None
        if engine is not None:
            engine.shutdown()
