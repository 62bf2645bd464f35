"""Checks before anything is applied: the source, the bucket size, the served model's spec, the
reach of CUDA IPC handles, and NaN/infinity (fused norms, or one CUDA graph of them)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

import torch

from rollgen.errors import RefitError
from rollgen.refit.meta import Named, TensorMeta, WeightSpec
from rollgen.refit.transports.base import Packet, transport_named

#: The dtypes a refit may cast to (``dtype=``): the engines' weight dtypes.
CAST_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_source(source: Any) -> None:
    """Check a refit's source.

    Raises:
        RefitError: unless ``source`` is a module or a mapping of names to torch tensors."""
    if isinstance(source, torch.nn.Module):
        return
    if not isinstance(source, Mapping):
        raise RefitError(
            f"a refit source is a torch.nn.Module or a mapping of names to tensors (a state dict), "
            f"got {type(source).__name__}"
        )
    bad = [str(k) for k, v in source.items() if not (isinstance(k, str) and isinstance(v, torch.Tensor))]
    if bad:
        raise RefitError("a state dict maps parameter names to torch tensors; these entries do not", bad)


def check_readable(named: Named) -> None:
    """Check that every tensor of a source holds values.

    Raises:
        RefitError: naming the tensors on the meta device."""
    empty = [name for name, tensor in named if tensor.is_meta]
    if empty:
        raise RefitError(
            "these tensors are on the meta device and hold no values; materialise them first "
            "(e.g. module.to_empty(device=...), then load their weights)",
            empty,
        )


def check_dtype(dtype: Any) -> None:
    """Check a refit's cast.

    Raises:
        RefitError: unless ``dtype`` is None or one of ``CAST_DTYPES``."""
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype in CAST_DTYPES):
        hint = f" (pass torch.{dtype})" if isinstance(dtype, str) and hasattr(torch, dtype) else ""
        raise RefitError(
            f"dtype must be None (no cast) or one of {', '.join(map(str, CAST_DTYPES))}, got {dtype!r}{hint}"
        )


def check_bucket_bytes(bucket_bytes: Any) -> None:
    """Check a refit's bucket size.

    Raises:
        RefitError: unless ``bucket_bytes`` is None or a positive integer."""
    if bucket_bytes is not None and (
        isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes <= 0
    ):
        raise RefitError(
            f"bucket_bytes must be None (the default size) or a positive int, got {bucket_bytes!r}"
        )


def check_against_spec(
    metas: Iterable[TensorMeta], expected: WeightSpec, partial: bool = False, adapter: bool = False
) -> None:
    """Check an update's tensors against the served model's (``adapter``: against the engine's
    adapter spec, which a refit sends whole).

    Args:
        metas: the update's names, shapes and dtypes.
        expected: the served model's ``WeightSpec`` (or the adapter's).
        partial: the update need cover only the module groups it sends.

    Raises:
        RefitError: listing every unknown name, shape or dtype mismatch, and every tensor of
            the served model the update leaves out."""
    metas = list(metas)
    of = "the engine's adapter (lora)" if adapter else "the served model"
    problems = []
    for m in metas:
        if m.name not in expected:
            hint = " (PEFT's names: peft.get_peft_model_state_dict(model))" if adapter else ""
            problems.append(f"{m.name}: not a tensor of {of}{hint}")
            continue
        shape, dtype = expected[m.name]
        if tuple(m.shape) != tuple(shape):
            problems.append(f"{m.name}: shape {list(m.shape)}, {of} has {list(shape)}")
        if m.dtype != dtype:
            problems.append(f"{m.name}: dtype {m.dtype}, {of} has {dtype} (pass dtype= to cast)")
    missing = expected.missing((m.name for m in metas), partial)
    if missing and partial:
        problems += [f"{n}: missing; a partial update sends whole module groups" for n in missing]
    elif missing:
        whole = (
            "an adapter refit sends the whole adapter"
            if adapter
            else "pass partial=True for a deliberate partial update"
        )
        problems += [f"{n}: missing ({whole})" for n in missing]
    if problems:
        kept = "adapter" if adapter else "weights"
        raise RefitError(
            f"{'adapter' if adapter else 'weight'} update rejected ({len(problems)} problem(s)); nothing "
            f"was applied and the engine keeps its previous {kept}",
            problems,
        )


def check_reach(bucket: Packet, engine_devices: Iterable[str]) -> None:
    """Check, on the driver before anything is sent, that a bucket reaches every engine GPU.

    Args:
        bucket: a packed bucket (its transport checks: only ``cuda_ipc`` names GPUs).
        engine_devices: the UUIDs of the engines' GPUs.

    Raises:
        RefitError: listing each engine GPU the bucket holds no handle for."""
    transport_named(bucket.transport).check_reach(bucket.payload, list(engine_devices))


@torch.no_grad()
def nonfinite(named: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
    """The names of the floating-point tensors that hold a NaN or an infinity: one fused 2-norm
    pass (in float32, float64 tensors in their own) and one host sync per device, with no kernel
    per tensor beyond it; a tensor whose norm is not finite is then checked element-wise (a huge
    but finite tensor overflows its norm)."""
    bad = []
    for (_, wide), group in _norm_groups(named).items():
        norms = _norms(group, wide)
        if not bool(norms.isfinite().all()):
            bad += _exactly_nonfinite(group, norms)
    return bad


def _norm_groups(
    named: Iterable[tuple[str, torch.Tensor]],
) -> dict[tuple[torch.device, bool], list[tuple[str, torch.Tensor]]]:
    """The floating-point tensors, by device and by whether they are float64 (``_foreach_norm``
    takes no narrowing dtype)."""
    groups: dict[tuple[torch.device, bool], list[tuple[str, torch.Tensor]]] = {}
    for name, tensor in named:
        if tensor.is_floating_point() and tensor.numel():
            groups.setdefault((tensor.device, tensor.dtype == torch.float64), []).append((name, tensor))
    return groups


def _norms(group: Sequence[tuple[str, torch.Tensor]], wide: bool) -> torch.Tensor:
    """Each tensor's 2-norm (float32, or float64 for ``wide`` groups), one fused pass."""
    tensors = [t for _, t in group]
    return torch.stack(torch._foreach_norm(tensors, 2, dtype=None if wide else torch.float32))


def _exactly_nonfinite(group: Sequence[tuple[str, torch.Tensor]], norms: torch.Tensor) -> list[str]:
    """Of the tensors whose norm is not finite, those that hold a NaN or an infinity."""
    suspects = (~norms.isfinite()).nonzero().flatten().tolist()
    return [group[i][0] for i in suspects if not bool(torch.isfinite(group[i][1]).all())]


class GraphedCheck:
    """``nonfinite`` of tensors that stay where they are (the same storages, places and forms at
    every call: a trainer's parameters, refitted in place), its fused norms captured once as a
    CUDA graph on their GPU and replayed: one launch instead of one per chunk of tensors
    (BENCHMARKS.md, the refit's kernels). The tensors must outlive it."""

    def __init__(self, named: Named) -> None:
        self._groups = list(_norm_groups(named).items())
        if self._groups:
            self._graph, (self._norms, self._finite) = graphed(self._run, self._groups[0][0][0])

    def _run(self) -> tuple[list[torch.Tensor], torch.Tensor]:
        norms = [_norms(group, wide) for (_, wide), group in self._groups]
        return norms, torch.stack([n.isfinite().all() for n in norms]).all()

    @torch.no_grad()
    def nonfinite(self) -> list[str]:
        """What ``nonfinite`` of the tensors returns now."""
        if not self._groups:
            return []
        self._graph.replay()
        if bool(self._finite):
            return []
        return [
            name
            for (_, group), norms in zip(self._groups, self._norms)
            for name in _exactly_nonfinite(group, norms)
        ]


T = TypeVar("T")


@torch.no_grad()
def graphed(fn: Callable[[], T], device: torch.device) -> tuple[torch.cuda.CUDAGraph, T]:
    """``fn`` captured as a CUDA graph; returns the graph and what ``fn`` returned in the capture.

    Args:
        fn: work on GPU ``device``, run once off the capture first (lazy initialisation).

    The graph replays on the current stream and rewrites the outputs ``fn`` returned. The
    capture runs on a stream of its own: the calling thread keeps its stream when it fails."""
    with torch.cuda.device(device):
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(side):
            fn()
            with torch.cuda.graph(graph, stream=side, capture_error_mode="thread_local"):
                out = fn()
        torch.cuda.current_stream(device).wait_stream(side)
    return graph, out


def require_finite(named: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Check the values of ``named``.

    Raises:
        RefitError: naming every tensor that holds a NaN or an infinity."""
    reject_nonfinite(nonfinite(named))


def reject_nonfinite(bad: list[str]) -> None:
    """Reject an update whose tensors ``bad`` (names) hold a NaN or an infinity.

    Raises:
        RefitError: naming them, if there are any."""
    if bad:
        raise RefitError(
            f"weight update rejected: {len(bad)} tensor(s) hold NaN or infinite values; nothing of "
            "them was applied (check the trainer's step; check_finite=False skips this check)",
            bad,
        )
