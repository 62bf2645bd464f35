"""Streamed rollouts against synchronous ``generate`` on a long-tail workload: output budgets
drawn from a log-normal distribution (most samples short, a few very long), as RL rollouts are.
A trainer with synchronous ``generate`` runs fixed batches and waits for each batch's longest
sample; with ``submit`` it keeps a window of samples in flight, submitting a new chunk whenever
enough have finished. Same engine, same prompts, same budgets, runs interleaved.

Also the pause a ``keep``-mode refit puts on running samples: the refit's wall time while a full
window streams, against the same refit on an idle engine."""

from __future__ import annotations

import asyncio
import math
import statistics
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

COLUMNS = ["method", "samples", "tokens", "median_s", "tok_s", "samples_s", "gpu_busy", "gpu_idle_share"]


def budgets(n: int, median: int, sigma: float, cap: int, seed: int = 0) -> torch.Tensor:
    """``n`` output budgets, log-normal around ``median`` (spread ``sigma``), within [4, cap]."""
    g = torch.Generator().manual_seed(seed)
    draws = torch.exp(math.log(median) + sigma * torch.randn(n, generator=g))
    return draws.round().clamp(4, cap).long()


def long_tail_batch(prompts: torch.Tensor, budget: torch.Tensor) -> dict[str, torch.Tensor]:
    """Equal-length ``prompts`` [N, L] with a ``max_new_tokens`` budget each."""
    n, length = prompts.shape
    return {"input_ids": prompts, "input_lengths": torch.full((n,), length), "max_new_tokens": budget}


def chunks(batch: dict[str, torch.Tensor], size: int) -> list[dict[str, torch.Tensor]]:
    n = batch["input_ids"].shape[0]
    return [{k: v[i : i + size] for k, v in batch.items()} for i in range(0, n, size)]


def synchronous(gen: Any, batch: dict[str, torch.Tensor], size: int) -> Callable[[], int]:
    """Fixed batches of ``size``, one ``generate`` after the other; returns tokens generated."""

    def run() -> int:
        total = 0
        for piece in chunks(batch, size):
            out = gen.generate(piece)
            total += int(out["generation_lengths"].sum())
        return total

    return run


def streaming(gen: Any, batch: dict[str, torch.Tensor], size: int, window: int) -> Callable[[], int]:
    """Chunks of ``size`` submitted whenever fewer than ``window - size`` samples are in flight;
    results taken with ``async for`` as they finish. Returns tokens generated."""

    async def main() -> int:
        in_flight, total = 0, 0
        freed = asyncio.Event()

        async def take(rollout: Any) -> None:
            nonlocal in_flight, total
            async for result in rollout:
                in_flight -= 1
                total += len(result.token_ids)
                freed.set()

        tasks = []
        for piece in chunks(batch, size):
            while in_flight + piece["input_ids"].shape[0] > window:
                freed.clear()
                await freed.wait()
            in_flight += piece["input_ids"].shape[0]
            tasks.append(asyncio.create_task(take(gen.submit(piece))))
        await asyncio.gather(*tasks)
        return total

    return lambda: asyncio.run(main())


class GpuBusy:
    """Samples ``nvidia-smi``'s utilization of one GPU (the share of each 100 ms in which a kernel
    ran) while in use; nothing where there is no ``nvidia-smi``."""

    def __init__(self, device: int = 0, period_ms: int = 100) -> None:
        self.device, self.period_ms = device, period_ms

    @contextmanager
    def sampling(self) -> Iterator[list[int]]:
        samples: list[int] = []
        try:
            proc = subprocess.Popen(
                [
                    "nvidia-smi",
                    f"--id={self.device}",
                    "--query-gpu=utilization.gpu",
                    "--format=csv,noheader,nounits",
                    f"-lms={self.period_ms}",
                ],
                stdout=subprocess.PIPE,
                text=True,
            )
        except FileNotFoundError:
            yield samples
            return

        def read() -> None:
            for line in proc.stdout or []:
                if line.strip().isdigit():
                    samples.append(int(line))

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        try:
            yield samples
        finally:
            proc.terminate()
            proc.wait()
            reader.join()


def measure(
    contestants: dict[str, Callable[[], int]], samples: int, repeats: int, gpu: GpuBusy | None
) -> list[dict[str, Any]]:
    """Each contestant ``repeats`` times, interleaved after one warm-up round each; throughput
    from the median wall time, GPU utilization over all of its runs."""
    for run in contestants.values():
        run()
    times: dict[str, list[float]] = {k: [] for k in contestants}
    tokens: dict[str, int] = {}
    busy: dict[str, list[int]] = {k: [] for k in contestants}
    names = list(contestants)
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            with gpu.sampling() if gpu else _nothing() as util:
                start = time.perf_counter()
                tokens[name] = contestants[name]()
                times[name].append(time.perf_counter() - start)
            busy[name] += util
    rows: list[dict[str, Any]] = []
    for name in names:
        median = statistics.median(times[name])
        util = busy[name]
        rows.append(
            {
                "method": name,
                "samples": samples,
                "tokens": tokens[name],
                "median_s": median,
                "times_s": times[name],
                "tok_s": tokens[name] / median,
                "samples_s": samples / median,
                "gpu_busy": statistics.mean(util) / 100 if util else None,
                "gpu_idle_share": sum(u == 0 for u in util) / len(util) if util else None,
            }
        )
    base = rows[0]["median_s"]
    for row in rows:
        row["speedup"] = base / row["median_s"]
    return rows


@contextmanager
def _nothing() -> Iterator[list[int]]:
    yield []


def keep_refit_pause(
    gen: Any, state: dict[str, torch.Tensor], batch: dict[str, torch.Tensor], first: int, repeats: int
) -> dict[str, Any]:
    """The wall time of ``refit(state, mode="keep")`` with ``batch`` streaming (called once
    ``first`` samples have finished), against ``refit(state)`` on the idle engine; how many
    samples the refit cut."""
    loaded, idle, cut = [], [], []
    for _ in range(repeats):
        start = time.perf_counter()
        gen.refit(state)
        idle.append(time.perf_counter() - start)
        rollout = gen.submit(batch)
        for taken, _result in enumerate(rollout, 1):
            if taken == first:
                break
        start = time.perf_counter()
        gen.refit(state, mode="keep")
        loaded.append(time.perf_counter() - start)
        cut.append(sum(len(r.versions) > 1 for r in rollout.wait()))
    return {
        "samples": int(batch["input_ids"].shape[0]),
        "refit_idle_ms": statistics.median(idle) * 1e3,
        "refit_keep_ms": statistics.median(loaded) * 1e3,
        "pause_ms": (statistics.median(loaded) - statistics.median(idle)) * 1e3,
        "samples_cut": statistics.median(cut),
        "refit_keep_times_ms": [t * 1e3 for t in loaded],
    }
