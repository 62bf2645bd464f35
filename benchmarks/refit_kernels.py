"""The device work of a colocated refit, without an engine: copies and NaN checks of the
Qwen2.5-1.5B-shape state dict (3.09 GB bf16, 338 tensors) on one GPU, each against the floor
of one device-to-device copy of the same bytes. Rows: packing into one flat buffer and loading
from it into separate tensors, fused (``torch._foreach_copy_``) or tensor by tensor; copying
tensor to tensor (what an engine reading the trainer's tensors in place makes); the checks
(``rollgen.refit.nonfinite``'s fused 2-norm, sums per tensor, either replayed as one CUDA graph,
one sum over the packed bytes).

    python -m benchmarks.refit_kernels --out out/benchmarks
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from benchmarks.common import print_table, qwen25_1p5b_dir, save_all, timed
from benchmarks.refit import copy_floor, random_state
from rollgen.model_info import ModelInfo
from rollgen.refit import GraphedCheck, TensorMeta, flat_offsets, graphed, nonfinite, unflatten


def per_tensor(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    for d, s in zip(dsts, srcs):
        d.copy_(s)


def sums_finite(tensors: list[torch.Tensor]) -> bool:
    return bool(all_finite_sums(tensors))


def split_finite(tensors: list[torch.Tensor]) -> bool:
    big = [t for t in tensors if t.numel() * t.element_size() > 1 << 20]
    small = [t for t in tensors if t.numel() * t.element_size() <= 1 << 20]
    parts = [t.sum(dtype=torch.float32).reshape(1) for t in big]
    parts += [torch.stack(torch._foreach_norm(small, 2, dtype=torch.float32))]
    return bool(torch.cat(parts).isfinite().all())


def all_finite_sums(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Whether every tensor's float32 sum is finite, on the device (no sync)."""
    return torch.stack([t.sum(dtype=torch.float32) for t in tensors]).isfinite().all()


def replayed(fn: Callable[[], Any], device: torch.device) -> Callable[[], Any]:
    """``fn`` (device work) captured once as a CUDA graph (``rollgen.refit.graphed``): each call
    replays it and returns what it returned then (a bool tensor is read, which waits for it)."""
    graph, out = graphed(fn, device)

    def replay() -> Any:
        graph.replay()
        return bool(out) if isinstance(out, torch.Tensor) else out

    return replay


def median_ms(fn: Callable[[], Any], repeats: int) -> float:
    fn()
    return statistics.median(timed(fn) for _ in range(repeats)) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", default="out/benchmarks")
    args = parser.parse_args()
    device = torch.device("cuda", 0)
    spec = ModelInfo.from_dir(qwen25_1p5b_dir()).weight_spec(torch.bfloat16)
    state = random_state(spec, device)
    named = [(n, t) for n, t in state.items() if n not in spec.tied]
    tensors = [t for _, t in named]
    metas = tuple(TensorMeta.of(n, t) for n, t in named)
    offsets = flat_offsets(m.nbytes for m in metas)
    flat = torch.zeros(offsets[-1], dtype=torch.uint8, device=device)
    views = unflatten(flat, metas, offsets)
    params = [torch.empty_like(t) for t in tensors]  # an engine's parameters
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    r = args.repeats
    floor = copy_floor(nbytes, device, r) * 1e3
    rows = {
        "pack, fused": median_ms(partial(torch._foreach_copy_, views, tensors), r),
        "pack, per tensor": median_ms(partial(per_tensor, views, tensors), r),
        "load from flat, fused": median_ms(partial(torch._foreach_copy_, params, views), r),
        "load from flat, per tensor": median_ms(partial(per_tensor, params, views), r),
        "tensor to tensor, fused": median_ms(partial(torch._foreach_copy_, params, tensors), r),
        "tensor to tensor, per tensor": median_ms(partial(per_tensor, params, tensors), r),
        "tensor to tensor, per tensor, replayed as one CUDA graph": median_ms(
            replayed(partial(per_tensor, params, tensors), device), r
        ),
        "check: fused 2-norm (nonfinite)": median_ms(partial(nonfinite, named), r),
        "check: fused 2-norms alone": median_ms(
            partial(torch._foreach_norm, tensors, 2, dtype=torch.float32), r
        ),
        "check: a sum per tensor": median_ms(partial(sums_finite, tensors), r),
        "check: a sum per tensor over 1 MiB, fused norms below": median_ms(partial(split_finite, tensors), r),
        "check: a sum per tensor, replayed as one CUDA graph": median_ms(
            replayed(partial(all_finite_sums, tensors), device), r
        ),
        "check: fused 2-norms, replayed as one CUDA graph (GraphedCheck)": median_ms(
            GraphedCheck(named).nonfinite, r
        ),
        "check: one sum of the packed bytes": median_ms(
            lambda: bool(torch.isfinite(flat.view(torch.bfloat16).sum(dtype=torch.float32))), r
        ),
    }
    table = [
        {"what": k, "ms": v, "vs_floor": v / floor, "gb": nbytes / 1e9, "tensors": len(tensors)}
        for k, v in {"d2d copy (floor)": floor, **rows}.items()
    ]
    print_table(table, ["what", "ms", "vs_floor", "gb", "tensors"])
    save_all("refit_kernels", {"kernels": table}, args.out)


if __name__ == "__main__":
    main()
