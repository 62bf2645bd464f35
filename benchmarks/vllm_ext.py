"""The benchmarks' vLLM worker extension: rollgen's, plus what only a benchmark asks of a worker
(a CPU profile of its step loop, the timings of the last refit bucket). Engines get it
through ``vllm_kwargs["worker_extension_cls"]`` (``EXTENSION``) and are asked through
``VllmGeneration.collective_rpc`` (or ``vllm.LLM.collective_rpc`` for a raw engine)."""

from __future__ import annotations

import cProfile
import statistics
import time
from typing import Any

import torch

from benchmarks import cpu_profile
from rollgen_vllm.extension import RollgenWorkerExtension
from rollgen_vllm.load_plan import LoadWay

EXTENSION = f"{__name__}.BenchWorkerExtension"


class BenchWorkerExtension(RollgenWorkerExtension):
    """Methods reached through ``collective_rpc``; ``self`` is a vLLM worker."""

    def rollgen_load_request(self, layout: str, data: bytes | None, replay: bool) -> bool:
        entered = time.time()  # wall clock: the driver compares it with its own
        loaded = super().rollgen_load_request(layout, data, replay)
        if loaded:  # a request that loads nothing leaves the last load's record
            self.bench_load.update(entered=entered, left=time.time())
        return loaded

    def rollgen_unpack(
        self, layout: str, data: bytes | None
    ) -> tuple[list[tuple[str, torch.Tensor]], bool] | None:
        start = time.perf_counter()
        unpacked = super().rollgen_unpack(layout, data)
        if unpacked is not None:
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
        """The seconds this rank spent mapping and loading the last bucket, how it loaded, and
        when (``time.time()``) the call entered and left the worker extension."""
        return dict(self.bench_load)

    def rollgen_take_adapter(
        self, version: int, data: bytes, setup: dict[str, Any], layout: str = ""
    ) -> None:
        self.bench_adapter: dict[str, float] = {}
        start = time.perf_counter()
        super().rollgen_take_adapter(version, data, setup, layout)
        _synchronize()
        self.bench_adapter["load_adapter_s"] = time.perf_counter() - start

    def rollgen_write_adapter(
        self, version: int, named: list[tuple[str, torch.Tensor]], setup: dict[str, Any]
    ) -> None:
        start = time.perf_counter()
        super().rollgen_write_adapter(version, named, setup)
        _synchronize()
        self.bench_adapter["write_s"] = time.perf_counter() - start

    def bench_last_adapter(self) -> dict[str, Any]:
        """Where this rank's last adapter load went: the whole ``rollgen_take_adapter``
        (``load_adapter_s``: unpickling and mapping the bucket, the slot write, a kept copy
        where the engine reloads) and the write into the LoRA slots (``write_s``), seconds,
        synchronised."""
        return dict(self.bench_adapter)

    def bench_kept_plan(self, repeats: int = 5) -> dict[str, Any]:
        """The kept load plan (the last staged or in-place refit's): its steps, its copies and how many of
        them ``torch._foreach_copy_``'s fused route refuses (dtypes, sizes or strides that
        differ, or a tensor that is not dense: then the whole run copies tensor by tensor), and
        the median seconds of its replay alone, synchronised."""
        kept = getattr(getattr(self, "rollgen_load_plans", None), "_kept", None)
        if kept is None:  # no plan kept (``--loaders``, or no staged refit yet)
            return {"replay_s": float("nan")}
        _, _, plan, sources = kept
        runs = [(step, srcs) for step, srcs in zip(plan.steps, sources) if srcs is not None]
        pairs = [(d, s) for step, srcs in runs for d, s in zip(step.dsts, srcs)]
        unfused = sum(not _fusable(d, s) for d, s in pairs)
        plan.copy(sources)
        times = []
        for _ in range(repeats):
            torch.cuda.synchronize()
            start = time.perf_counter()
            plan.copy(sources)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        return {
            "steps": len(plan.steps),
            "copy_runs": len(runs),
            "copies": len(pairs),
            "unfusable_copies": unfused,
            "runs_with_unfusable": sum(not all(map(_fusable, st.dsts, sr)) for st, sr in runs),
            "replay_s": statistics.median(times),
        }

    def bench_plan_steps(self, repeats: int = 5) -> dict[str, Any]:
        """The kept plan's replay (the last in-place or staged refit's) by the kinds of its
        steps: the median seconds, synchronised, of the whole replay (``replay_s``), of each
        kind's steps alone (``<Kind>_s``, with ``<Kind>_steps``), and of the quantizing steps'
        (``rollgen_vllm.quant_plan.Quantize``) parts alone: the gathering into the scratch
        tensor (``gather_s``), the kernels (``kernel_s``: each on what was gathered last, so
        wrong values) and the scale copies (``scales_s``). A whole replay runs last, so the
        weights end as the refit left them."""
        from rollgen_vllm.quant_plan import Quantize, broadcast

        plans = getattr(self, "rollgen_quant_plans", None) or getattr(self, "rollgen_load_plans", None)
        kept = getattr(plans, "_kept", None)  # a quantized engine's plans are the quant ones
        if kept is None:
            return {"replay_s": float("nan")}
        _, _, plan, sources = kept
        pairs = list(zip(plan.steps, sources))

        def median_s(fn: Any) -> float:
            fn()
            times = []
            for _ in range(repeats):
                _synchronize()
                start = time.perf_counter()
                fn()
                _synchronize()
                times.append(time.perf_counter() - start)
            return statistics.median(times)

        out: dict[str, Any] = {"steps": len(pairs), "replay_s": median_s(lambda: plan.copy(sources))}
        kinds: dict[str, list[tuple[Any, Any]]] = {}
        for step, srcs in pairs:
            kinds.setdefault(type(step).__name__, []).append((step, srcs))
        for kind, group in kinds.items():
            out[f"{kind}_steps"] = len(group)
            out[f"{kind}_s"] = median_s(lambda group=group: [step.run(srcs) for step, srcs in group])
        quantized = [(step, srcs) for step, srcs in pairs if isinstance(step, Quantize)]
        if quantized:
            out["gather_s"] = median_s(lambda: [step.gather(srcs) for step, srcs in quantized])
            inputs = [step.gather(srcs) for step, srcs in quantized]  # the last gathered, where shared
            out["kernel_s"] = median_s(
                lambda: [
                    (step.scale.zero_(), step.kernel(step.out, x, step.scale))
                    for (step, _), x in zip(quantized, inputs)
                ]
            )
            out["scales_s"] = median_s(lambda: [broadcast(step.scale, step.scales) for step, _ in quantized])
        plan.copy(sources)
        _synchronize()
        return out

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
        return cpu_profile.stats(profiler, top)


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _fusable(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """Whether ``torch._foreach_copy_`` may copy this pair on its fused route."""
    same = dst.dtype == src.dtype and dst.shape == src.shape and dst.stride() == src.stride()
    return same and _dense(dst) and _dense(src)


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t`` covers its bytes exactly once (non-overlapping and dense, in any order)."""
    expected = 1
    dims = sorted((s, n) for n, s in zip(t.shape, t.stride()) if n != 1)
    for stride, size in dims:
        if stride != expected:
            return False
        expected *= size
    return True
