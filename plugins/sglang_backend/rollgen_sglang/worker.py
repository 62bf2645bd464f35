"""``SglangWorker``: the Ray actor that owns one ``sglang.Engine`` (the leader of a tied group)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from rollgen.distributed.worker import EngineWorker
from rollgen.distributed.worker_groups import TiedGroup
from rollgen.errors import ConfigError, InputError, RefitError, RollgenError
from rollgen.refit import WeightBucket, WeightSpec, device_uuid
from rollgen.refit.transports.collective import SyncGroup, SyncGroupSpec, receive
from rollgen.rollout import SampleRequest
from rollgen.sampling import SampleParams

logger = logging.getLogger(__name__)

#: Seconds one ``_step`` waits for a streamed sample to move before it returns (so new and
#: aborted samples are taken up that soon).
STEP_WAIT_S = 0.05
#: Seconds a prefix-cache flush waits for aborted requests to leave SGLang's scheduler.
FLUSH_WAIT_S = 60.0
#: Seconds the tasks that ask Ray for the GPU of each of the group's bundles may take.
GPU_IDS_TIMEOUT_S = 60.0


def _bundle_gpu_ids(group: TiedGroup) -> list[str]:
    """Physical GPU ids of the tied group's bundles, asked of Ray by a tiny task in each."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    pg = ray.util.get_current_placement_group()

    @ray.remote(num_gpus=0.01, num_cpus=0)
    def gpu_id() -> str:
        return str(ray.get_gpu_ids()[0])

    refs = [
        gpu_id.options(
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=b)
        ).remote()
        for b in group.bundle_indices
    ]
    try:
        return list(ray.get(refs, timeout=GPU_IDS_TIMEOUT_S))
    except ray.exceptions.GetTimeoutError:
        for ref in refs:
            ray.cancel(ref, force=True)
        raise RollgenError(
            f"Ray did not run a task in each of the engine's placement-group bundles "
            f"{list(group.bundle_indices)} within {GPU_IDS_TIMEOUT_S:g} s (are their GPUs taken?); "
            "the engine did not start"
        ) from None


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


def keys_prefixes_by_version(kwargs: Mapping[str, Any], environ: Mapping[str, str]) -> bool:
    """Whether an SGLang engine of these ``sglang.Engine`` arguments (and this environment) keys
    its prefix cache by a request's ``extra_key`` (SGLang 0.5.16): its default radix cache and
    the others do, its experimental C++ radix tree (``SGLANG_EXPERIMENTAL_CPP_RADIX_TREE``)
    matches token ids alone, so refits flush the cache there.

    Raises:
        ConfigError: HiCache with a storage tier (``hicache_storage_backend``), whose pages are
            found by a hash of token ids alone and survive a flush, so KV computed under old
            weights would be served after a refit."""
    if kwargs.get("enable_hierarchical_cache") and kwargs.get("hicache_storage_backend"):
        raise ConfigError(
            "sglang_kwargs: HiCache's storage tier (hicache_storage_backend) finds KV pages by their "
            "token ids alone and keeps them through a cache flush, so pages computed under earlier "
            "weights would be served after a refit; leave hicache_storage_backend unset"
        )
    return environ.get("SGLANG_EXPERIMENTAL_CPP_RADIX_TREE", "").lower() not in ("1", "true", "yes", "y")


def sglang_request(input_ids: Any, sampling: Any, salt: str | list[str], **fields: Any) -> Any:
    """SGLang's request (``GenerateReqInput``) for one prompt or a batch, with logprobs, keyed
    in SGLang's prefix cache by ``salt`` (``SampleParams.prefix_salt``: the weight version the
    sample decodes with) as its ``extra_key``, as SGLang's own server passes a ``cache_salt``:
    the radix cache then matches no prefix computed under other weights, and a refit needs no
    flush. ``Engine.generate`` takes no such key; the worker hands the request to the engine's
    tokenizer manager as ``Engine.generate`` does. ``fields``: other fields (``stream``, ``rid``)."""
    from sglang.srt.managers.io_struct import GenerateReqInput

    return GenerateReqInput(
        input_ids=input_ids, sampling_params=sampling, return_logprob=True, extra_key=salt, **fields
    )


class StreamedRequests:
    """Streamed samples as SGLang streaming requests on the engine's event loop (one task each,
    keyed by ``rid``), and what they produced since the last look. Apart from the actor class:
    Ray runs an actor with coroutine methods on an event loop of its own, which SGLang would
    then take for its own."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self._following: dict[str, asyncio.Task[None]] = {}
        self._moved: list[tuple[str, list[int], list[float], bool]] = []
        self._failed: list[str] = []
        self._news = asyncio.Event()

    def add(self, requests: list[SampleRequest], params: list[dict[str, Any]]) -> None:
        for request, sp in zip(requests, params):
            self._following[request.key] = self.engine.loop.create_task(self._follow(request, sp))

    async def _follow(self, request: SampleRequest, params: dict[str, Any]) -> None:
        """Run one streamed sample, recording the tokens and logprobs of each chunk as it comes
        (SGLang's chunks carry the whole output so far)."""
        sent = 0
        try:
            salt = request.params.prefix_salt
            req = sglang_request(list(request.prompt_ids), params, salt, stream=True, rid=request.key)
            async for chunk in self.engine.tokenizer_manager.generate_request(req, None):
                ids, lps = chunk["output_ids"], chunk["meta_info"]["output_token_logprobs"]
                end = min(len(ids), len(lps))
                reason = chunk["meta_info"]["finish_reason"]
                if isinstance(reason, dict) and reason.get("type") == "abort":  # not asked for: a fault
                    raise RollgenError(f"SGLang aborted it: {reason.get('message')}")
                finished = reason is not None
                self._moved.append(
                    (request.key, list(ids[sent:end]), [float(x[0]) for x in lps[sent:end]], finished)
                )
                sent = end
                self._news.set()
        except Exception as exc:  # noqa: BLE001 - raised by moves(), which fails the engine's samples
            self._failed.append(f"sample {request.key}: {type(exc).__name__}: {exc}")
            self._news.set()
        finally:
            self._following.pop(request.key, None)

    async def moves(self) -> list[tuple[str, list[int], list[float], bool]]:
        """What the samples produced since the last call (waits up to ``STEP_WAIT_S`` for some):
        (key, new tokens, their logprobs, ended) per chunk."""
        if not (self._moved or self._failed):
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._news.wait(), STEP_WAIT_S)
        self._news.clear()
        if self._failed:
            failed, self._failed = self._failed, []
            raise RollgenError(f"SGLang failed streamed samples: {'; '.join(failed)}")
        moved, self._moved = self._moved, []
        return moved

    async def abort(self, keys: list[str]) -> None:
        """Abort the requests (in the loop: SGLang's sockets need it) and end their tasks."""
        for key in keys:
            self.engine.tokenizer_manager.abort_request(rid=key)
            task = self._following.pop(key, None)
            if task is not None:
                task.cancel()
        await asyncio.sleep(0)  # the cancelled tasks end


class SglangWorker(EngineWorker):
    """Owns ``sglang.Engine``; TP > 1 runs SGLang's own TP processes on the group's GPUs.

    Streamed samples are SGLang streaming requests (``StreamedRequests``) on the engine's own
    event loop, which the decoding thread runs in ``_step``; an abort is SGLang's
    ``abort_request`` and the end of the sample's task. The core runs nothing else on the
    engine while samples stream, so one thread runs the loop at a time."""

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
        self.versioned_prefixes = keys_prefixes_by_version(kwargs, os.environ)
        self.engine = sglang.Engine(**kwargs)
        self.version = sglang.__version__
        self.streams = StreamedRequests(self.engine)

    def _describe(self) -> dict[str, Any]:
        return {"sglang": self.version}

    def _generate(
        self, prompts: list[list[int]], params: Sequence[SampleParams]
    ) -> tuple[list[list[int]], list[list[float]]]:
        req = sglang_request(prompts, sampling_params(params, self.seeded), [p.prefix_salt for p in params])
        outputs = self.engine.loop.run_until_complete(
            self.engine.tokenizer_manager.generate_request(req, None).__anext__()
        )
        tokens = [list(o["output_ids"]) for o in outputs]
        logprobs = [[float(x[0]) for x in o["meta_info"]["output_token_logprobs"]] for o in outputs]
        return tokens, logprobs

    def _add_samples(self, requests: list[SampleRequest]) -> None:
        self.streams.add(requests, sampling_params([r.params for r in requests], self.seeded))

    def _step(self) -> list[tuple[str, list[int], list[float], bool]]:
        return self.engine.loop.run_until_complete(self.streams.moves())

    def _abort_samples(self, keys: list[str]) -> None:
        self.engine.loop.run_until_complete(self.streams.abort(keys))

    def _load_bucket(self, bucket: WeightBucket) -> None:
        """Rebuild the CUDA IPC tensors on this GPU and hand them to SGLang, which loads them into
        every TP rank (each keeps its shard). torch cannot pass on a tensor it received over IPC,
        so each is copied once on the device first (one bucket at a time, so bounded)."""
        self._load_named([(name, t.clone()) for name, t in bucket.unpack("cuda:0")])

    def _load_named(self, named: list[tuple[str, Any]]) -> None:
        ok, message = self.engine.update_weights_from_tensor(named, flush_cache=False)
        if not ok:
            raise RefitError(f"SGLang did not load the bucket: {message}")

    def _devices(self) -> list[str]:
        """The GPU this worker maps CUDA IPC handles on and receives broadcasts on (its first:
        SGLang's own TP ranks take what it loads)."""
        return [device_uuid(torch.device("cuda", 0))]

    def _join_weight_sync(self, spec: SyncGroupSpec, first_rank: int) -> None:
        """This worker joins for its whole engine, as one rank on its first GPU (gloo: in host
        memory); SGLang's TP ranks take what it receives."""
        self.sync = SyncGroup(spec, first_rank, torch.device("cuda", 0))

    def _receive_weights(self, spec: WeightSpec) -> bool:
        # receive's tensors are views of its two receive buffers, which it reuses two buckets
        # later: SGLang has loaded each bucket by then (update_weights_from_tensor returns after)
        return receive(self.sync, spec, self._load_named)

    def _reset_prefix_cache(self) -> None:
        # SGLang flushes only an idle scheduler: wait for aborted requests to leave it
        flushed = self.engine.loop.run_until_complete(
            self.engine.tokenizer_manager.flush_cache(timeout_s=FLUSH_WAIT_S)
        )
        if not flushed.success:
            raise RollgenError(
                f"SGLang did not flush its prefix cache within {FLUSH_WAIT_S:.0f} s ({flushed.message}): "
                "its scheduler still holds requests; retry the call, or shut the generation down"
            )

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
