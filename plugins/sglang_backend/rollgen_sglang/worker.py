"""``SglangWorker``: the Ray actor that owns one ``sglang.Engine`` (the leader of a tied group)."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

from rollgen.distributed.worker import EngineWorker
from rollgen.distributed.worker_groups import TiedGroup
from rollgen.errors import InputError, RefitError
from rollgen.refit import WeightBucket
from rollgen.sampling import SampleParams

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


def sampling_params(params: Sequence[SampleParams], seeded: bool) -> list[dict[str, Any]]:
    """SGLang's sampling parameters for each sample (stop strings and ids kept in the output)."""
    out = []
    for p in params:
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
            if not seeded:
                raise InputError(
                    "SGLang ignores per-sample seeds without deterministic inference; "
                    "set sglang_cfg.deterministic_inference (or leave it None with a config seed)"
                )
            sp["sampling_seed"] = p.seed
        out.append(sp)
    return out


class SglangWorker(EngineWorker):
    """Owns ``sglang.Engine``; TP > 1 runs SGLang's own TP processes on the group's GPUs."""

    engine_processes = ("sglang::scheduler", "sglang::detokenizer")

    def _start(self) -> None:
        spec, scfg = self.spec, self.spec.engine
        tp = spec.tensor_parallel_size
        if tp > 1:
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(_bundle_gpu_ids(spec.group))
        if spec.logprobs_mode == "raw":
            # SGLang returns the sampled (tempered) distribution's logprobs unless told otherwise
            os.environ["SGLANG_RETURN_ORIGINAL_LOGPROB"] = "1"
        import sglang

        deterministic = scfg["deterministic_inference"]
        self.seeded = spec.seed is not None if deterministic is None else bool(deterministic)
        kwargs: dict[str, Any] = {
            "model_path": spec.model_name,
            "dtype": spec.dtype,
            "tp_size": tp,
            "mem_fraction_static": scfg["mem_fraction_static"],
            "enable_memory_saver": spec.sleep_enabled,
            "enable_weights_cpu_backup": scfg["enable_weights_cpu_backup"] and spec.sleep_enabled,
            "disable_cuda_graph": scfg["disable_cuda_graph"],
            "load_format": scfg["load_format"],
            "context_length": spec.context_length,
            "random_seed": 0 if spec.seed is None else spec.seed,
            "log_level": scfg["log_level"],
            "enable_deterministic_inference": self.seeded,
            "sleep_on_idle": scfg["sleep_on_idle"],
        }
        if spec.dtype == "float32":
            kwargs["attention_backend"] = "triton"  # FA3 (Hopper's default) takes half precision only
        kwargs.update(spec.engine_kwargs)
        self.engine = sglang.Engine(**kwargs)
        self.version = sglang.__version__

    def _describe(self) -> dict[str, Any]:
        return {"sglang": self.version}

    def _generate(
        self, prompts: list[list[int]], params: Sequence[SampleParams]
    ) -> tuple[list[list[int]], list[list[float]]]:
        outputs = self.engine.generate(
            input_ids=prompts, sampling_params=sampling_params(params, self.seeded), return_logprob=True
        )
        tokens = [list(o["output_ids"]) for o in outputs]
        logprobs = [[float(x[0]) for x in o["meta_info"]["output_token_logprobs"]] for o in outputs]
        return tokens, logprobs

    def _load_bucket(self, bucket: WeightBucket) -> None:
        """Rebuild the CUDA IPC tensors on this GPU and hand them to SGLang, which loads them into
        every TP rank (each keeps its shard). torch cannot pass on a tensor it received over IPC,
        so each is copied once on the device first (one bucket at a time, so bounded)."""
        named = [(name, t.clone()) for name, t in bucket.unpack("cuda:0")]
        ok, message = self.engine.update_weights_from_tensor(named, flush_cache=False)
        if not ok:
            raise RefitError(f"SGLang did not load the bucket: {message}")

    def _reset_prefix_cache(self) -> None:
        self.engine.flush_cache()

    def _release_memory(self) -> None:
        self.engine.release_memory_occupation()

    def _resume_memory(self, tags: list[str]) -> None:
        # release_memory_occupation() also paused the CUDA graphs: they come back with the KV cache
        extra = ["cuda_graph"] if "kv_cache" in tags else []
        self.engine.resume_memory_occupation(tags=[*tags, *extra])

    def _stop(self) -> None:
        engine, self.engine = getattr(self, "engine", None), None
        if engine is not None:
            engine.shutdown()
