"""Replayable refits of an engine that quantizes as it loads (vLLM's online FP8 per tensor): record
once what vLLM's layerwise reload does with a layout, then refit that layout without the reload.

For each layer, the reload builds the layer's tensors anew in the checkpoint's dtype, runs the
weight loaders into them, quantizes the linear ones (``process_weights_after_loading``: one
``dynamic_scaled_fp8_quant`` per fused layer, which finds the scale and writes the FP8 values) and
copies the results into the tensors the kernels and CUDA graphs read. ``QuantRecorder`` watches
that once and notes, for each tensor the reload built, which slices of the incoming tensors (and
which constant fills) the loaders wrote into it, and where it went: copied as it was into a live
tensor (a norm, the embeddings, a bias), or quantized, its FP8 values and its scale copied into a
layer's ``weight`` and ``weight_scale``.

The replay makes the first kind of copy straight into the live tensors (``load_plan.CopyRun``).
For each quantized layer (``Quantize``) it gathers the layer's slices into a scratch tensor (one
per engine and dtype, ``Scratch``, the size of the largest layer; a single incoming tensor of the
layer's dtype laid out as the whole layer is read where it lies) and calls the same kernel on it,
writing the FP8 values straight into the storage of the layer's ``weight`` and the scale into a
kept buffer, then copies the scale where the reload copied it. Same kernel, same values: the same
bytes. The reload's allocations, Python per layer and second copy are what it saves.

Anything else the reload did with the incoming values or what it made of them (a repack, a
padding, a transpose made contiguous, a cast, a scale clamped or reduced across ranks in place)
gives no plan, and that layout reloads every time. As for bf16 plans (``load_plan.LoadPlans``),
a plan is trusted only once verified: replayed, then reloaded, and kept only if the reload wrote
the FP8 values and scales the replay wrote and changed no other parameter.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch

from rollgen.refit.meta import contiguous_strides
from rollgen_vllm.load_plan import (
    CONSTANT_WRITES,
    ConstantWrite,
    CopyRun,
    NoPlan,
    Recorder,
    Source,
    Step,
    storage,
    tensors,
    written,
)

aten = torch.ops.aten
#: The quantization kernel the recorder follows, by its name (vLLM's ``_C`` op: one scale for the
#: whole input, amax / 448, written into its scale argument, and the input's FP8 values).
QUANT_KERNEL = "dynamic_scaled_fp8_quant"

#: A view's place in its storage: size, stride, storage offset (in elements).
Geometry = tuple[tuple[int, ...], tuple[int, ...], int]


def geometry(t: torch.Tensor) -> Geometry:
    return tuple(t.shape), tuple(t.stride()), int(t.storage_offset())


def count(g: Geometry) -> int:
    """The elements of a view of geometry ``g``."""
    return math.prod(g[0])


def dense(g: Geometry) -> bool:
    """Whether a view of geometry ``g`` is one contiguous run of elements."""
    return g[1] == contiguous_strides(g[0])


def whole(t: torch.Tensor) -> bool:
    """Whether ``t`` is all of its storage, laid out contiguously from its start."""
    size = t.untyped_storage().nbytes()
    return t.is_contiguous() and t.storage_offset() == 0 and t.numel() * t.element_size() == size


@dataclass(frozen=True)
class Fill:
    """A constant write the loaders made (a fill, a zeroing): its function, the arguments after
    the tensor, and where it wrote."""

    func: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    at: Geometry

    def into(self, target: torch.Tensor) -> ConstantWrite:
        """The same write into ``target``, laid out as the tensor it was made into."""
        return ConstantWrite(self.func, (target.as_strided(*self.at), *self.args), self.kwargs)


@dataclass
class Built:
    """A tensor the reload built (``size`` elements), and what the loaders wrote into it: copies
    of incoming views (``Source``, where) and constant writes."""

    size: int
    dtype: torch.dtype
    copies: list[tuple[Source, Geometry]] = field(default_factory=list)
    fills: list[Fill] = field(default_factory=list)

    def covered(self) -> bool:
        """Whether the loaders' copies and fills wrote every element exactly once (dense runs)."""
        places = [g for _, g in self.copies] + [f.at for f in self.fills]
        end = 0
        for start, stop in sorted((g[2], g[2] + count(g)) for g in places):
            if start != end:
                return False
            end = stop
        return all(dense(g) for g in places) and end == self.size

    def writes_into(self, target: torch.Tensor) -> list[Step]:
        """The loaders' writes, made into ``target`` (laid out as this tensor) instead."""
        steps: list[Step] = [f.into(target) for f in self.fills]
        if self.copies:
            steps.append(
                CopyRun([target.as_strided(*g) for _, g in self.copies], [s for s, _ in self.copies])
            )
        return steps


@dataclass
class Quantized:
    """A built tensor quantized by ``kernel`` (read as ``input``, its values written as
    ``values``), and the live tensors its values and its scale were copied into."""

    built: Built
    kernel: Any
    input: Geometry
    values: Geometry
    weight: torch.Tensor | None = None
    scales: list[torch.Tensor] = field(default_factory=list)


class Scratch:
    """One engine's scratch tensors, one per dtype, each grown to the largest layer any of its
    plans gathers (plans read it as they run: one that grows serves the plans made before)."""

    def __init__(self) -> None:
        self.held: dict[torch.dtype, torch.Tensor] = {}

    def reserve(self, size: int, dtype: torch.dtype, device: torch.device) -> None:
        held = self.held.get(dtype)
        if held is None or held.numel() < size:
            self.held[dtype] = torch.empty(size, dtype=dtype, device=device)


def broadcast(scale: torch.Tensor, into: list[torch.Tensor]) -> None:
    """Copy the one-element ``scale`` into each tensor of ``into``, whatever its shape."""
    if into:
        torch._foreach_copy_(into, [scale.reshape(()).expand(t.shape) for t in into])


class Quantize:
    """One quantized layer's replay: gather its slices into the scratch tensor (or read its one
    incoming tensor where it lies), quantize them with the engine's kernel straight into the
    layer's weight, its scale into ``scale``, and copy the scale where the reload did."""

    def __init__(self, q: Quantized, scratch: Scratch, scale: torch.Tensor) -> None:
        self.kernel, self.scale, self.scales = q.kernel, scale, q.scales
        self.out = cast(torch.Tensor, q.weight).as_strided(*q.values)
        self.scratch, self.built, self.input = scratch, q.built, q.input
        one = q.built.copies[0][0] if len(q.built.copies) == 1 and not q.built.fills else None
        self.direct = one is not None and (one.size, one.stride) == q.input[:2]
        self.srcs = [s for s, _ in q.built.copies]
        #: The scratch tensor the views below are of (made again where it grew), the fills, the
        #: copies' destinations and the kernel's input in it.
        self.gathered: tuple[torch.Tensor, list[ConstantWrite], list[torch.Tensor], torch.Tensor] | None = (
            None
        )

    def sources(self, incoming: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        return [s.of(incoming) for s in self.srcs]

    def run(self, sources: list[torch.Tensor]) -> None:
        self.quantize(sources, self.out, self.scale)
        broadcast(self.scale, self.scales)

    def quantize(self, sources: list[torch.Tensor], out: torch.Tensor, scale: torch.Tensor) -> None:
        """The layer's FP8 values into ``out``, its scale into ``scale``."""
        source = self.gather(sources)
        scale.zero_()  # vLLM's caller passes an empty scale: zeroed, in case a build takes a max
        self.kernel(out, source, scale)

    def gather(self, sources: list[torch.Tensor]) -> torch.Tensor:
        """The kernel's input: the layer's one incoming tensor where it lies, if it is on the
        layer's device in the layer's dtype (the loaders cast a host tensor from a weight-sync
        group, or another dtype, as they copy); else its slices gathered into the scratch
        tensor."""
        source = sources[0] if sources else None
        if (
            self.direct
            and source is not None
            and (source.device, source.dtype) == (self.out.device, self.built.dtype)
        ):
            return source
        _, fills, dsts, gathered = self.views()
        for fill in fills:
            fill.run(None)
        torch._foreach_copy_(dsts, sources)
        return gathered

    def views(self) -> tuple[torch.Tensor, list[ConstantWrite], list[torch.Tensor], torch.Tensor]:
        """The gathering's views of the scratch tensor as it is now (made once for each)."""
        buf = self.scratch.held[self.built.dtype]
        if self.gathered is None or self.gathered[0] is not buf:
            fills = [f.into(buf) for f in self.built.fills]
            dsts = [buf.as_strided(*g) for _, g in self.built.copies]
            self.gathered = (buf, fills, dsts, buf.as_strided(*self.input))
        return self.gathered

    def writes(self) -> list[torch.Tensor]:
        return [self.out, *self.scales]

    def mismatch(self, incoming: Sequence[torch.Tensor]) -> str | None:
        """Whether the layer's weight and scales differ from what this step makes of
        ``incoming``."""
        out, scale = torch.empty_like(self.out), torch.zeros_like(self.scale)
        self.quantize(self.sources(incoming), out, scale)
        if not torch.equal(out.view(torch.uint8), self.out.view(torch.uint8)):
            return f"the FP8 values of a {list(out.shape)} layer"
        if not all(torch.equal(t, scale.reshape(()).expand(t.shape)) for t in self.scales):
            return f"the scale of a {list(out.shape)} layer"
        return None


class QuantRecorder(Recorder):
    """Runs an engine's reload and notes what a plan of copies and ``Quantize`` steps needs
    (module docstring), gathering into ``scratch`` (the engine's, shared by its plans). Tensors
    are told apart by their storage: ``params`` (the engine's parameters and buffers) are the
    live ones, and storage the reload frees and allocates again is a new tensor."""

    def __init__(
        self, incoming: Sequence[torch.Tensor], params: Sequence[torch.Tensor], scratch: Scratch
    ) -> None:
        super().__init__(incoming, params)
        self.scratch = scratch
        self.live = {storage(p) for p in params if p.numel()}
        self.built: dict[int, Built] = {}
        self.quantized: dict[int, Quantized] = {}
        self.scaled: dict[int, Quantized] = {}  # a scale, or a tensor its copies alone filled
        self.tainted: set[int] = set()  # made from incoming values any other way
        self.fed: set[int] = set()  # live tensors the reload wrote incoming values into
        self.order: list[Quantized] = []
        self.copied: list[tuple[Built, torch.Tensor]] = []  # built tensors copied whole into live ones

    def observe(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        inputs = {storage(t) for t in tensors((args, kwargs)) if not t.is_meta}
        for t in tensors(out):  # storage the op allocated: what was there is gone
            if not t.is_meta and storage(t) not in inputs:
                self.forget(storage(t))
        if any(t.is_meta for t in tensors((args, kwargs, out))):  # the reload's bookkeeping
            return
        if func is aten.copy_.default:
            self.follow_copy(args[0], args[1])
        elif func._schema.name.split("::")[-1] == QUANT_KERNEL:
            self.follow_quantize(func, *args[:3])
        elif func in CONSTANT_WRITES and (built := self.built.get(storage(args[0]))) is not None:
            built.fills.append(Fill(func, tuple(args[1:]), kwargs, geometry(args[0])))
        else:
            self.follow_other(func, args, kwargs, out)

    def forget(self, ptr: int) -> None:
        self.built.pop(ptr, None)
        self.quantized.pop(ptr, None)
        self.scaled.pop(ptr, None)
        self.tainted.discard(ptr)

    def role(self, t: torch.Tensor) -> str | None:
        ptr = storage(t)
        if ptr in self.storages:
            return "incoming"
        for name, held in (("built", self.built), ("quantized", self.quantized), ("scaled", self.scaled)):
            if ptr in held:
                return name
        return "tainted" if ptr in self.tainted or ptr in self.fed else None

    def follow_copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if not dst.numel():
            return
        source, into = self.role(src), self.role(dst)
        rescaled = into == "scaled" and (
            source != "scaled" or self.scaled[storage(dst)] is not self.scaled[storage(src)]
        )
        if into in ("incoming", "quantized") or (into == "built" and source != "incoming") or rescaled:
            raise NoPlan("the reload writes into the incoming tensors or what it made of them")
        if storage(dst) not in self.live:
            if source == "incoming":
                size = dst.untyped_storage().nbytes() // dst.element_size()
                self.built.setdefault(storage(dst), Built(size, dst.dtype)).copies.append(
                    (self.source(src), geometry(dst))
                )
            elif source == "scaled":
                self.scaled[storage(dst)] = self.scaled[storage(src)]
            elif source is not None:
                self.tainted.add(storage(dst))
            return
        if source is not None:
            self.fed.add(storage(dst))
        if source == "incoming":
            self.add_copy(dst, src)
        elif source == "built":
            if not whole(src) or geometry(src) != geometry(dst):
                raise NoPlan("the reload copies part of a layer it built into a parameter")
            self.copied.append((self.built[storage(src)], dst))
        elif source == "quantized":
            q = self.quantized[storage(src)]
            if geometry(src) != geometry(dst) or src.numel() != q.built.size or q.weight is not None:
                raise NoPlan("the reload copies quantized values into a parameter laid out otherwise")
            q.weight = dst
        elif source == "scaled":
            self.scaled[storage(src)].scales.append(dst)
        elif source == "tainted":
            raise NoPlan("the reload copies values it computed from the incoming tensors into a parameter")

    def follow_quantize(
        self, kernel: Any, values: torch.Tensor, source: torch.Tensor, scale: torch.Tensor
    ) -> None:
        built = self.built.get(storage(source))
        if built is None:
            if self.role(source) is not None:
                raise NoPlan("the reload quantizes values other than a layer the loaders wrote")
            return
        if not whole(source) or not whole(values) or scale.numel() != 1 or not built.covered():
            raise NoPlan("the reload quantizes a layer the loaders did not write whole")
        if self.role(values) is not None or self.role(scale) is not None:
            raise NoPlan("the reload quantizes into tensors it made of the incoming ones")
        q = Quantized(built, kernel, geometry(source), geometry(values))
        self.quantized[storage(values)] = self.scaled[storage(scale)] = q
        self.order.append(q)

    def follow_other(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        inputs = tensors((args, kwargs))
        roles = {self.role(t) for t in inputs} - {None}
        writes = written(func, args, kwargs)
        for t in writes:
            if self.role(t) in ("incoming", "built", "quantized", "scaled"):
                raise NoPlan(
                    f"the reload writes into the incoming tensors or what it made of them with {func}"
                )
            if roles and storage(t) in self.live:
                raise NoPlan(f"the reload writes values computed from the incoming tensors with {func}")
        for t in writes + tensors(out) if roles else []:
            if self.role(t) is None:  # computed from them (a view of a tracked tensor keeps its role)
                self.tainted.add(storage(t))

    def plan_steps(self) -> list[Step]:
        """Copies into live tensors (straight ones, then built tensors copied whole), then one
        ``Quantize`` per quantized layer, in the reload's order."""
        steps: list[Step] = list(self.steps)
        for built, target in self.copied:
            if not built.covered():
                raise NoPlan("the reload copies a layer the loaders did not write whole into a parameter")
            steps += built.writes_into(target)
        if not self.order:
            return steps
        if any(q.weight is None or not q.scales for q in self.order):
            raise NoPlan("the reload quantized a layer whose values or scale reached no parameter")
        device = cast(torch.Tensor, self.order[0].weight).device
        for q in self.order:
            self.scratch.reserve(q.built.size, q.built.dtype, device)
        scales = torch.zeros(len(self.order), dtype=torch.float32, device=device)
        return steps + [Quantize(q, self.scratch, scales[i : i + 1]) for i, q in enumerate(self.order)]
