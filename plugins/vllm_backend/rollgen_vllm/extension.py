"""Worker extension loaded into every vLLM worker (``worker_extension_cls``)."""

from __future__ import annotations

import cProfile
import pickle
import time
from typing import Any

import torch

from rollgen.load_plan import LoadPlans


class RollgenWorkerExtension:
    """Methods reached through ``LLM.collective_rpc``; ``self`` is a vLLM worker."""

    def rollgen_device_uuid(self) -> str:
        from rollgen.refit import device_uuid

        return device_uuid(self.device) if torch.cuda.is_available() else "cpu"

    def rollgen_load_bucket(self, per_rank: list[bytes], replay: bool) -> dict[str, Any]:
        """Load one pickled WeightBucket of HF-named full tensors (``per_rank[rank]``); each
        rank keeps its own shard. Returns the tensor count, the seconds spent mapping the bucket
        and loading it, and how it was loaded (for profiles)."""
        start = time.perf_counter()
        bucket = pickle.loads(per_rank[getattr(self, "rank", 0)])
        on_gpu = torch.cuda.is_available()
        named = bucket.unpack(self.device if on_gpu else None)
        mapped = time.perf_counter()
        way = "loaded"
        if on_gpu:
            # the weight loaders copy into the live parameters (each rank its shard)
            model = self.model_runner.model
            if not replay:
                model.load_weights(weights=named)
            else:
                if not hasattr(self, "rollgen_load_plans"):
                    self.rollgen_load_plans = LoadPlans(model.parameters)
                way = self.rollgen_load_plans.load(named, lambda w: model.load_weights(weights=w))
            torch.cuda.synchronize()  # the sender frees the bucket once this returns
        else:
            # vLLM-CPU prepacks linear weights, which plain load_weights cannot write into; the
            # layerwise reload re-runs the repacking (it walks the whole model on every call)
            self.reload_weights(weights_iterator=iter(named), is_checkpoint_format=True)
        return {
            "tensors": len(named),
            "map_s": mapped - start,
            "load_s": time.perf_counter() - mapped,
            "way": way,
        }

    def rollgen_profile(self, start: bool, top: int = 40) -> dict[str, Any] | None:
        """A CPU profile (cProfile) of the thread that runs this worker's steps: at TP=1 the
        engine core's busy loop (scheduling, the model's launches, sampling, outputs). ``start``
        begins one; then the next call ends it and returns the profiled seconds and the ``top``
        functions by their own time (for benchmarks/: where one engine's steps spend more CPU
        time than another's)."""
        if start:
            self.rollgen_profiler = cProfile.Profile()
            self.rollgen_profiler.enable()
            return None
        profiler = self.rollgen_profiler
        profiler.disable()
        del self.rollgen_profiler
        entries = profiler.getstats()
        top_entries = sorted(entries, key=lambda e: e.inlinetime, reverse=True)[:top]
        return {
            "profiled_s": sum(e.inlinetime for e in entries),
            "top": [
                {"function": _where(e.code), "calls": e.callcount, "own_s": e.inlinetime} for e in top_entries
            ],
        }


def _where(code: Any) -> str:
    """A profiled function as ``file.py:line(name)`` (built-ins as cProfile names them)."""
    if isinstance(code, str):
        return code
    return f"{code.co_filename.rsplit('/', 1)[-1]}:{code.co_firstlineno}({code.co_name})"
