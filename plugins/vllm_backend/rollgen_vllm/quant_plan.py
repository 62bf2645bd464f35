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
For each quantized layer (``Quantize``) it gathers the layer's slices into a kept scratch tensor
(a single incoming tensor laid out as the whole layer is read where it lies) and calls the same
kernel on it, writing the FP8 values straight into the storage of the layer's ``weight`` and the
scale into a kept buffer, then copies the scale where the reload copied it. Same kernel, same
values: the same bytes. The reload's allocations, Python per layer and second copy are what it
saves.

Anything else the reload computed from the incoming values (a repack, a padding, a transpose made
contiguous, a cast, scales reduced across ranks) gives no plan, and that layout reloads every
time. As for bf16 plans (``load_plan.LoadPlans``), a plan is trusted only once verified: replayed,
then reloaded, and kept only if the reload changed no parameter.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch.utils._pytree import tree_leaves

from rollgen_vllm.load_plan import (
    CONSTANT_WRITES,
    ConstantWrite,
    CopyRun,
    NoPlan,
    Recorder,
    Source,
    Step,
    overlapping,
)

aten = torch.ops.aten
#: The quantization kernel the recorder follows, by its name (vLLM's ``_C`` op: it finds one
#: scale for the whole input, amax / 448, takes it as the max into its scale argument, and
#: writes the input's FP8 values).
QUANT_KERNEL = "dynamic_scaled_fp8_quant"

#: A view's place in its storage: size, stride, storage offset (in elements).
Geometry = tuple[tuple[int, ...], tuple[int, ...], int]


def geometry(t: torch.Tensor) -> Geometry:
    return tuple(t.shape), tuple(t.stride()), int(t.storage_offset())


def numel(g: Geometry) -> int:
    return math.prod(g[0])


def dense(g: Geometry) -> bool:
    """Whether a view of geometry ``g`` is one contiguous run of elements."""
    return g[1] == torch.empty(g[0], device="meta").stride()


def whole(t: torch.Tensor) -> bool:
    """Whether ``t`` is all of its storage, laid out contiguously from its start."""
    size = t.untyped_storage().nbytes()
    return t.is_contiguous() and t.storage_offset() == 0 and t.numel() * t.element_size() == size


def storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


#: A constant write the loaders made: its function, the arguments after the tensor, keyword
#: arguments, and where it wrote.
Fill = tuple[Any, tuple[Any, ...], dict[str, Any], Geometry]


@dataclass
class Built:
    """A tensor the reload built, and what the loaders wrote into it: copies of incoming views
    (``Source``, where) and constant writes."""

    numel: int
    dtype: torch.dtype
    copies: list[tuple[Source, Geometry]] = field(default_factory=list)
    fills: list[Fill] = field(default_factory=list)

    def covered(self) -> bool:
        """Whether the loaders' copies and fills wrote every element exactly once (dense runs)."""
        places = [g for _, g in self.copies] + [f[3] for f in self.fills]
        end = 0
        for start, stop in sorted((g[2], g[2] + numel(g)) for g in places):
            if start != end:
                return False
            end = stop
        return all(dense(g) for g in places) and end == self.numel

    def writes_into(self, target: torch.Tensor) -> list[Step]:
        """The loaders' writes, made into ``target`` (laid out as this tensor) instead."""
        steps: list[Step] = [ConstantWrite(f, (target.as_strided(*g), *a), k) for f, a, k, g in self.fills]
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


class Quantize:
    """One quantized layer's replay: gather its slices into ``scratch`` (or read its one incoming
    tensor where it lies), quantize them with the engine's kernel straight into the layer's
    weight, its scale into ``scale``, and copy the scale where the reload did."""

    def __init__(self, q: Quantized, scratch: torch.Tensor, scale: torch.Tensor) -> None:
        self.kernel, self.scale, self.scales = q.kernel, scale, q.scales
        self.out = cast(torch.Tensor, q.weight).as_strided(*q.values)
        copies = q.built.copies
        one = copies[0][0] if len(copies) == 1 and not q.built.fills else None
        self.direct = one is not None and (one.size, one.stride) == q.input[:2]
        self.srcs = [s for s, _ in copies]
        self.fills = [ConstantWrite(f, (scratch.as_strided(*g), *a), k) for f, a, k, g in q.built.fills]
        self.dsts = [scratch.as_strided(*g) for _, g in copies]
        self.input = scratch.as_strided(*q.input)

    def sources(self, incoming: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        return [s.of(incoming) for s in self.srcs]

    def run(self, sources: list[torch.Tensor]) -> None:
        self.quantize(sources, self.out, self.scale)
        if self.scales:
            torch._foreach_copy_(self.scales, [self.scale.reshape(()).expand(t.shape) for t in self.scales])

    def quantize(self, sources: list[torch.Tensor], out: torch.Tensor, scale: torch.Tensor) -> None:
        """The layer's FP8 values into ``out``, its scale into ``scale``; a layer that is one
        incoming tensor on the layer's device is read where it lies."""
        direct = self.direct and sources[0].device == out.device  # not a host tensor (gloo)
        if not direct:
            for fill in self.fills:
                fill.run(None)
            torch._foreach_copy_(self.dsts, sources)
        scale.zero_()  # the kernel takes the max into it
        self.kernel(out, sources[0] if direct else self.input, scale)

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
    (module docstring). Tensors are told apart by their storage: ``params`` (the engine's
    parameters and buffers) are the live ones, and storage the reload frees and allocates again
    is a new tensor."""

    def __init__(self, incoming: Sequence[torch.Tensor], params: Sequence[torch.Tensor]) -> None:
        super().__init__(incoming, params)
        self.live = {storage(p) for p in params if p.numel()}
        self.built: dict[int, Built] = {}
        self.quantized: dict[int, Quantized] = {}
        self.scaled: dict[int, Quantized] = {}  # a scale, or a tensor made from one alone
        self.tainted: set[int] = set()  # made from incoming values any other way
        self.fed: set[int] = set()  # live tensors the reload wrote incoming values into
        self.order: list[Quantized] = []
        self.copied: list[tuple[Built, torch.Tensor]] = []  # built tensors copied whole into live ones

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        inputs = tensors((args, kwargs))
        out = func(*args, **kwargs)
        if self.reason is None:
            try:
                if not any(t.is_meta for t in inputs + tensors(out)):  # the reload's bookkeeping
                    before = {storage(t) for t in inputs}
                    for t in tensors(out):  # storage the op allocated: what was there is gone
                        if storage(t) not in before:
                            self.forget(storage(t))
                    self.follow(func, args, kwargs, inputs, out)
            except NoPlan as e:
                self.reason = str(e)
            except (RuntimeError, NotImplementedError) as e:  # e.g. a tensor without storage
                self.reason = f"the recorder cannot follow {func}: {e}"  # the reload itself goes on
        return out

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

    def follow(
        self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], inputs: list[torch.Tensor], out: Any
    ) -> None:
        if func is aten.copy_.default:
            self.follow_copy(args[0], args[1])
        elif func._schema.name.split("::")[-1] == QUANT_KERNEL:
            self.follow_quantize(func, *args[:3])
        elif func in CONSTANT_WRITES and (built := self.built.get(storage(args[0]))) is not None:
            built.fills.append((func, tuple(args[1:]), kwargs, geometry(args[0])))
        else:
            self.follow_other(func, args, kwargs, inputs, out)

    def follow_copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if not dst.numel():
            return
        source, into = self.role(src), self.role(dst)
        if into == "built" and source != "incoming":
            raise NoPlan("the loaders write values other than incoming ones into a layer")
        if storage(dst) not in self.live:
            if source == "incoming":
                built = self.built.setdefault(
                    storage(dst), Built(dst.untyped_storage().nbytes() // dst.element_size(), dst.dtype)
                )
                built.copies.append((self.source(src), geometry(dst)))
            elif source == "scaled":
                self.scaled[storage(dst)] = self.scaled[storage(src)]
            elif source is not None:
                self.tainted.add(storage(dst))
        elif source == "incoming":
            self.add_copy(dst, src)
            self.fed.add(storage(dst))
        elif source == "built":
            if not whole(src) or geometry(src) != geometry(dst):
                raise NoPlan("the reload copies part of a layer it built into a parameter")
            self.copied.append((self.built[storage(src)], dst))
            self.fed.add(storage(dst))
        elif source == "quantized":
            q = self.quantized[storage(src)]
            if geometry(src) != geometry(dst) or src.numel() != q.built.numel:
                raise NoPlan("the reload copies quantized values into a parameter laid out otherwise")
            q.weight = dst
            self.fed.add(storage(dst))
        elif source == "scaled":
            self.scaled[storage(src)].scales.append(dst)
            self.fed.add(storage(dst))
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
        q = Quantized(built, kernel, geometry(source), geometry(values))
        self.quantized[storage(values)] = self.scaled[storage(scale)] = q
        self.order.append(q)

    def follow_other(
        self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], inputs: list[torch.Tensor], out: Any
    ) -> None:
        roles = {self.role(t) for t in inputs} - {None}
        schema = func._schema
        values = [args[i] if i < len(args) else kwargs.get(a.name) for i, a in enumerate(schema.arguments)]
        written = [
            v
            for a, v in zip(schema.arguments, values)
            if isinstance(v, torch.Tensor) and a.alias_info is not None and a.alias_info.is_write
        ]
        for t in written:
            if self.role(t) == "built":
                raise NoPlan(f"the loaders write into a layer with {func}")
            if roles and storage(t) in self.live:
                raise NoPlan(f"the reload writes values computed from the incoming tensors with {func}")
        if not roles:
            return
        scale = next((self.scaled[storage(t)] for t in inputs if storage(t) in self.scaled), None)
        for t in written + tensors(out):
            if self.role(t) is None:  # a view of a tracked tensor keeps that tensor's role
                if roles == {"scaled"} and scale is not None:
                    self.scaled[storage(t)] = scale
                else:
                    self.tainted.add(storage(t))

    def finish(self) -> list[Step]:
        """Copies into live tensors (straight ones, then built tensors copied whole), then one
        ``Quantize`` per quantized layer, in the reload's order."""
        steps: list[Step] = list(super().finish())
        for built, target in self.copied:
            if not built.covered():
                raise NoPlan("the reload copies a layer the loaders did not write whole into a parameter")
            steps += built.writes_into(target)
        if overlapping([d for s in steps if isinstance(s, CopyRun) for d in s.dsts]):
            raise NoPlan("the loaders write one place twice")
        if not self.order:
            return steps
        if len({q.built.dtype for q in self.order}) > 1:
            raise NoPlan("the reload builds quantized layers in more than one dtype")
        if any(q.weight is None for q in self.order):
            raise NoPlan("the reload quantized a layer whose values reached no parameter")
        device = cast(torch.Tensor, self.order[0].weight).device
        largest = max(q.built.numel for q in self.order)  # a host tensor read directly is gathered
        scratch = torch.empty(largest, dtype=self.order[0].built.dtype, device=device)
        scales = torch.zeros(len(self.order), dtype=torch.float32, device=device)
        return steps + [Quantize(q, scratch, scales[i : i + 1]) for i, q in enumerate(self.order)]


def tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]
