"""Replayable weight loading: run an engine's weight loaders once under a recorder, then load
later refits of the same layout by replaying the copies they made, fused.

An engine's loaders (vLLM's ``load_weights``) map checkpoint names onto its fused, sharded
parameters in Python, tensor by tensor. For a refit with the same names, shapes and dtypes the
mapping is the same every time, so the recorder notes which slice of which incoming tensor each
loader copied into which slice of which tensor, and the replay makes those copies with one
``torch._foreach_copy_`` per run of copies.

A plan is kept only when the recording shows the loaders did nothing else: views of the incoming
tensors copied into tensors that existed before, and constant fills. A loader that computes on the
incoming values (a cast, a transpose made contiguous, a concatenation), writes another way,
rebinds a parameter, or writes one place twice gets no plan: that layout goes through the loaders
every time. A replay first checks that the module's parameters are the ones recorded.

A plan is trusted only once verified on new values: the second load of a layout replays the plan
and then runs the loaders as well, and keeps the plan only if every copy's destination equals its
source and the loaders changed no parameter (``checksum``: per-parameter float64 sums) after the
replay. A write the recorder cannot see (one made outside torch's dispatcher) or a wrong mapping
drops the plan, with a warning; the loaders' result stands either way. A verifying load whose
values equal those already loaded cannot show a write the plan misses (the loaders rewrite what
is there): a trainer's refits carry new values, and a refit of unchanged tensors proves nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from rollgen.refit import Named

logger = logging.getLogger(__name__)

aten = torch.ops.aten
#: How a load went: replayed from a plan, loaded while recording one, loaded while verifying one
#: (replay, then the loaders), or loaded without a plan.
LoadWay = Literal["replayed", "recorded", "verified", "loaded"]
#: Writes a plan may hold besides copies from the incoming tensors (they take no tensor input).
CONSTANT_WRITES = {aten.fill_.Scalar, aten.zero_.default}


@dataclass(frozen=True)
class Source:
    """A view of incoming tensor ``index``: ``offset`` elements from its start."""

    index: int
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]

    def of(self, incoming: Sequence[torch.Tensor]) -> torch.Tensor:
        t = incoming[self.index]
        return t.as_strided(self.size, self.stride, t.storage_offset() + self.offset)


@dataclass
class CopyRun:
    """Consecutive copies from incoming views, made as one fused copy."""

    dsts: list[torch.Tensor] = field(default_factory=list)
    srcs: list[Source] = field(default_factory=list)

    def sources(self, incoming: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        return [s.of(incoming) for s in self.srcs]

    def run(self, sources: list[torch.Tensor]) -> None:
        torch._foreach_copy_(self.dsts, sources)

    def writes(self) -> list[torch.Tensor]:
        return self.dsts

    def mismatch(self, incoming: Sequence[torch.Tensor]) -> str | None:
        """The first copy whose destination differs from its source, if any; compared on the
        destination's device and in its dtype, as the copy casts (a weight-sync group over gloo
        delivers host tensors to a GPU engine)."""
        for dst, src in zip(self.dsts, self.srcs):
            if not torch.equal(dst, src.of(incoming).to(dst)):
                return f"a copy from incoming tensor {src.index} into a {list(dst.shape)} slice"
        return None


@dataclass
class ConstantWrite:
    """A write that takes no incoming value (a fill, a zeroing)."""

    func: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]

    def sources(self, incoming: Sequence[torch.Tensor]) -> None:
        return None

    def run(self, sources: None) -> None:
        self.func(*self.args, **self.kwargs)

    def writes(self) -> list[torch.Tensor]:
        return []  # a fill may precede a copy into the same place

    def mismatch(self, incoming: Sequence[torch.Tensor]) -> str | None:
        return None


class Step(Protocol):
    """One step of a plan: its views of the incoming tensors (made once for a kept list), the
    writes it makes from them and where, and (after a load) the first write that differs from
    them."""

    def sources(self, incoming: Sequence[torch.Tensor]) -> Any: ...

    def run(self, sources: Any) -> None: ...

    def writes(self) -> list[torch.Tensor]: ...

    def mismatch(self, incoming: Sequence[torch.Tensor]) -> str | None: ...


@dataclass
class Plan:
    steps: list[Step]
    #: ``data_ptr`` of every parameter when recorded; a replay needs the same.
    params: tuple[int, ...]
    verified: bool = False

    def sources(self, incoming: Sequence[torch.Tensor]) -> list[Any]:
        """Each step's views of ``incoming``."""
        return [step.sources(incoming) for step in self.steps]

    @torch.no_grad()
    def copy(self, sources: Sequence[Any]) -> None:
        """Make the plan's writes from ``sources`` (``sources`` of the incoming tensors)."""
        for step, srcs in zip(self.steps, sources):
            step.run(srcs)

    def mismatch(self, incoming: Sequence[torch.Tensor]) -> str | None:
        """The first copy whose destination differs from its source (after a load), if any."""
        return next((m for step in self.steps if (m := step.mismatch(incoming)) is not None), None)


class NoPlan(Exception):
    """What the loaders did that a plan cannot replay (internal: ends a recording)."""


def storage(t: torch.Tensor) -> int:
    """Where ``t``'s storage starts: what tells tensors apart while a recorder watches."""
    return t.untyped_storage().data_ptr()


def tensors(tree: Any) -> list[torch.Tensor]:
    """The tensors in ``tree`` (an op's arguments or results)."""
    return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]


def written(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The tensors op ``func`` writes into (its schema's mutable arguments)."""
    schema = func._schema
    values = [args[i] if i < len(args) else kwargs.get(a.name) for i, a in enumerate(schema.arguments)]
    return [
        v
        for a, v in zip(schema.arguments, values)
        if isinstance(v, torch.Tensor) and a.alias_info is not None and a.alias_info.is_write
    ]


class Recorder(TorchDispatchMode):
    """Runs the loaders and notes their writes as plan steps. ``params``: the engine's tensors
    when the recording starts (a subclass's to read; this one needs only the incoming ones)."""

    def __init__(self, incoming: Sequence[torch.Tensor], params: Sequence[torch.Tensor]) -> None:
        super().__init__()
        self.incoming = incoming
        self.storages = {storage(t) for t in incoming if t.numel()}
        self.steps: list[Step] = []
        self.reason: str | None = None

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.reason is None:
            try:
                self.observe(func, args, kwargs, out)
            except NoPlan as e:
                self.reason = str(e)
            except Exception as e:  # noqa: BLE001 - whatever it is, the load itself goes on, unplanned
                self.reason = f"the recorder cannot follow {func}: {type(e).__name__}: {e}"
        return out

    def observe(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        """Note one op the loaders ran (``out``: what it returned)."""
        self.note(func, args, kwargs)

    def finish(self) -> list[Step]:
        """The plan's steps, once the loaders have run; ``NoPlan`` says why there is none."""
        if self.reason is not None:
            raise NoPlan(self.reason)
        steps = self.plan_steps()
        if overlapping([t for step in steps for t in step.writes()]):
            raise NoPlan("the loaders write one place twice")
        return steps

    def plan_steps(self) -> list[Step]:
        """The steps noted."""
        return self.steps

    def is_incoming(self, t: Any) -> bool:
        return isinstance(t, torch.Tensor) and t.numel() > 0 and storage(t) in self.storages

    def note(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        writes = written(func, args, kwargs)
        reads_incoming = any(self.is_incoming(t) for t in tree_leaves((args, kwargs)))
        if func is aten.copy_.default and not args[0].numel():
            return
        if func is aten.copy_.default and self.is_incoming(args[1]) and not self.is_incoming(args[0]):
            self.add_copy(args[0], args[1])
        elif writes:
            if func not in CONSTANT_WRITES or reads_incoming:
                raise NoPlan(f"the loaders write with {func} (only copies of incoming tensors replay)")
            self.steps.append(ConstantWrite(func, args, kwargs))
        elif reads_incoming and not all(r.alias_info is not None for r in func._schema.returns):
            raise NoPlan(f"the loaders compute on incoming values with {func}")

    def add_copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        source = self.source(src)
        run = self.steps[-1] if self.steps else None
        if not isinstance(run, CopyRun):
            run = CopyRun()
            self.steps.append(run)
        run.dsts.append(dst)
        run.srcs.append(source)

    def source(self, view: torch.Tensor) -> Source:
        """``view`` as a view of an incoming tensor."""
        index = next((i for i, t in enumerate(self.incoming) if holds(t, view)), None)
        if index is None:
            raise NoPlan("a copy's source lies outside the incoming tensors")
        t = self.incoming[index]
        if view.dtype != t.dtype:
            raise NoPlan(f"the loaders view {t.dtype} incoming data as {view.dtype}")
        offset = (view.data_ptr() - t.data_ptr()) // t.element_size()
        return Source(index, offset, tuple(view.shape), tuple(view.stride()))


def holds(t: torch.Tensor, view: torch.Tensor) -> bool:
    """Whether ``view`` starts inside ``t``'s bytes."""
    start = t.data_ptr()
    same = t.numel() > 0 and storage(t) == storage(view)
    return same and start <= view.data_ptr() < start + t.numel() * t.element_size()


def byte_span(t: torch.Tensor) -> tuple[int, int, int]:
    """(storage, first byte, one past the last byte) that ``t`` may touch."""
    extent = sum((n - 1) * s for n, s in zip(t.shape, t.stride())) + 1
    return t.untyped_storage().data_ptr(), t.data_ptr(), t.data_ptr() + extent * t.element_size()


def overlapping(dsts: Iterable[torch.Tensor]) -> bool:
    spans = sorted(byte_span(t) for t in dsts)
    return any(a[0] == b[0] and b[1] < a[2] for a, b in zip(spans, spans[1:]))


def bound_parameters(model: torch.nn.Module, buffers: bool = False) -> Callable[[], Iterator[torch.Tensor]]:
    """``model``'s parameters (and ``buffers``) as bound at each call (a tied one as often as it
    is bound), over its modules listed once (an engine adds none after loading): a rebound
    parameter shows, at a fraction of the cost of ``Module.parameters()``'s walk of the module
    tree."""
    modules = list(model.modules())
    if buffers:
        return lambda: (
            t for m in modules for d in (m._parameters, m._buffers) for t in d.values() if t is not None
        )
    return lambda: (p for m in modules for p in m._parameters.values() if p is not None)


class LoadPlans:
    """The plans of one model, by incoming layout (names, shapes, dtypes, strides, devices)."""

    def __init__(
        self,
        params: Callable[[], Iterable[torch.Tensor]],
        recorder: Callable[[Sequence[torch.Tensor], Sequence[torch.Tensor]], Recorder] = Recorder,
    ) -> None:
        self.params = params
        self.recorder = recorder
        self.plans: dict[tuple[Any, ...], Plan | None] = {}
        #: A kept incoming list (``load(keep=True)``: views of a staging buffer, the same list
        #: every refit), its layout, its verified plan and that plan's sources.
        self._kept: tuple[Named, tuple[Any, ...], Plan, list[list[torch.Tensor] | None]] | None = None

    def fingerprint(self) -> tuple[int, ...]:
        return tuple(p.data_ptr() for p in self.params())

    def load(self, named: Named, loader: Callable[[Named], object], keep: bool = False) -> LoadWay:
        """Load ``named``: by its layout's plan, or through ``loader`` (recording a plan the first
        time this layout is seen). ``keep``: ``named`` comes again as the same list with new
        values (a staging buffer's views), so its layout and its plan's sources are kept for
        then (until ``forget_kept``)."""
        kept = self._kept if self._kept is not None and self._kept[0] is named else None
        # the device too: a layout recorded from GPU tensors (CUDA IPC) does not replay host ones (gloo)
        key = kept[1] if kept else tuple((n, tuple(t.shape), t.dtype, t.stride(), t.device) for n, t in named)
        incoming = [t for _, t in named]
        plan = self.plans.get(key)
        if plan is not None and plan.params == self.fingerprint():
            # the kept sources only while the plan they were made for is the layout's plan
            sources = kept[3] if kept and kept[2] is plan else plan.sources(incoming)
            plan.copy(sources)
            if plan.verified:
                if keep:
                    self._kept = (named, key, plan, sources)
                return "replayed"
            self.verify(key, plan, named, incoming, loader)
            return "verified"
        if key in self.plans and plan is None:
            loader(named)
            return "loaded"
        params = list(self.params())
        before = tuple(p.data_ptr() for p in params)
        plan = None
        with self.recorder(incoming, params) as recorder:
            loader(named)
        try:
            steps = recorder.finish()
            if self.fingerprint() != before:
                raise NoPlan("the loaders rebound parameters")
            plan = Plan(steps, before)
        except (NoPlan, RuntimeError) as e:  # RuntimeError: e.g. out of memory for a plan's buffers
            logger.info("weights of this layout load through the engine's loaders each time: %s", e)
        self.plans[key] = plan
        return "recorded"

    def forget_kept(self) -> None:
        """Let go of the kept incoming list (its staging buffer is being released)."""
        self._kept = None

    def verify(
        self,
        key: tuple[Any, ...],
        plan: Plan,
        named: Named,
        incoming: Sequence[torch.Tensor],
        loader: Callable[[Named], object],
    ) -> None:
        """After ``plan`` was replayed: run the loaders too, and keep the plan only if they
        changed nothing and every copy landed where they put it."""
        replayed = self.sums()
        loader(named)
        try:
            problem = plan.mismatch(incoming)
        except RuntimeError as e:  # e.g. out of memory for a comparison's copy
            problem = f"the comparison could not run: {e}"
        if problem is None and not torch.equal(replayed, self.sums()):
            problem = "the loaders changed parameters after the replay (a write the recorder did not see)"
        if problem is not None:
            logger.warning(
                "dropped the load plan of this layout (%s); the engine's loaders load it each time", problem
            )
            self.plans[key] = None
        plan.verified = problem is None

    @torch.no_grad()
    def sums(self) -> torch.Tensor:
        """Each parameter's checksum (``checksum``)."""
        sums = [checksum(p) for p in self.params()]
        return torch.cat([t.to(sums[0].device) for t in sums]) if sums else torch.zeros(0)


def checksum(t: torch.Tensor) -> torch.Tensor:
    """``t``'s float64 sum; an FP8 tensor's (one byte an element, which sums do not take) the
    sum and 2-norm of its bytes."""
    if t.is_floating_point() and t.element_size() == 1:
        b = t.view(torch.uint8).float()
        return torch.stack([b.sum(dtype=torch.float64), torch.linalg.vector_norm(b, dtype=torch.float64)])
    return t.sum(dtype=torch.float64).reshape(1)
