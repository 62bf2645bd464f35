"""The benchmarks' vLLM worker extension: rollgen's, plus what only a benchmark asks of a worker
(a CPU profile of its step loop, the timings of the last refit bucket). Engines get it
through ``vllm_kwargs["worker_extension_cls"]`` (``EXTENSION``) and are asked through
``VllmGeneration.collective_rpc`` (or ``vllm.LLM.collective_rpc`` for a raw engine)."""

from __future__ import annotations

import cProfile
import time
from typing import Any

import torch

from rollgen_vllm.extension import RollgenWorkerExtension
from rollgen_vllm.load_plan import LoadWay

EXTENSION = f"{__name__}.BenchWorkerExtension"


class BenchWorkerExtension(RollgenWorkerExtension):
    """Methods reached through ``collective_rpc``; ``self`` is a vLLM worker."""

    def rollgen_unpack(self, per_rank: list[bytes]) -> tuple[list[tuple[str, torch.Tensor]], bool]:
        start = time.perf_counter()
        unpacked = super().rollgen_unpack(per_rank)
        self.bench_load = {"map_s": time.perf_counter() - start}
        return unpacked

    def rollgen_load(
        self, named: list[tuple[str, torch.Tensor]], replay: bool, kept: bool = False
    ) -> LoadWay:
        start = time.perf_counter()
        way = super().rollgen_load(named, replay, kept)
        self.bench_load.update(load_s=time.perf_counter() - start, way=way, tensors=len(named))
        return way

    def bench_last_load(self) -> dict[str, Any]:
        """The seconds this rank spent mapping and loading the last bucket, and how it loaded."""
        return dict(self.bench_load)

    def bench_profile(self, start: bool, top: int = 40) -> dict[str, Any] | None:
        """A CPU profile (cProfile) of the thread that runs this worker's steps: at TP=1 the
        engine core's busy loop (scheduling, the model's launches, sampling, outputs). ``start``
        begins one; the next call ends it and returns the profiled seconds and the ``top``
        functions by their own time."""
        if start:
            self.bench_profiler = cProfile.Profile()
            self.bench_profiler.enable()
            return None
        profiler = self.bench_profiler
        profiler.disable()
        del self.bench_profiler
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
