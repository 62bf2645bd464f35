"""Quantizing load plans (rollgen_vllm.quant_plan) against a stand-in of vLLM's layerwise reload
of an online-FP8 engine: vLLM-CPU has no FP8 kernels, so the engine here is a small module whose
``reload`` does what vLLM 0.26's does per layer (build the layer's tensors anew in bf16, load the
slices into them, quantize the fused linear layers with a per-tensor FP8 kernel, copy the results
into the live tensors) and the kernel is a CPU stand-in registered under vLLM's kernel name. The
real engine runs in ``tests/test_gpu.py::test_an_fp8_engine_refits_from_a_bf16_trainer``. A
replayed refit must leave every live tensor byte for byte as the reload would; a reload the
recorder cannot follow must still load, every time."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import pytest
import torch

from rollgen_vllm.load_plan import LoadPlans
from rollgen_vllm.quant_plan import Quantize, QuantRecorder

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
    weight stored [out, in] and bound transposed, its scale per channel (a fused layer's one
    scale repeated, as the CUTLASS kernel takes it); a bf16 norm, a padded bf16 embedding."""

    def __init__(self, pad: bool = False) -> None:
        super().__init__()
        self.pad = pad
        self.qkv_w = torch.nn.Parameter(torch.zeros(3 * H, H, dtype=FP8).t(), requires_grad=False)
        self.qkv_s = torch.nn.Parameter(torch.zeros(3 * H, 1), requires_grad=False)
        self.o_w = torch.nn.Parameter(torch.zeros(H, H, dtype=FP8).t(), requires_grad=False)
        self.o_s = torch.nn.Parameter(torch.zeros(1), requires_grad=False)
        self.norm = torch.nn.Parameter(torch.zeros(H, dtype=torch.bfloat16), requires_grad=False)
        self.embed = torch.nn.Parameter(
            torch.full((PADDED, H), 7.0, dtype=torch.bfloat16), requires_grad=False
        )

    def tensors(self) -> list[torch.Tensor]:
        return list(self.parameters())

    @torch.no_grad()
    def reload(self, named: Named) -> None:
        """vLLM's layerwise reload, layer by layer: build in bf16, load, quantize, copy back."""
        got = dict(named)
        qkv = torch.empty(3 * H, H, dtype=torch.bfloat16)
        for i, n in enumerate("qkv"):
            qkv.narrow(0, i * H, H).copy_(got[n])
        self.quantize(qkv, self.qkv_w, self.qkv_s)
        o = torch.empty(H, H, dtype=torch.bfloat16)
        o.copy_(got["o"])
        self.quantize(o, self.o_w, self.o_s)
        norm = torch.empty(H, dtype=torch.bfloat16)
        norm.copy_(got["norm"])
        self.norm.data.copy_(norm)
        embed = torch.empty(PADDED, H, dtype=torch.bfloat16)
        embed[:VOCAB].copy_(got["embed"])
        embed[VOCAB:].fill_(0)
        self.embed.data.copy_(embed)

    def quantize(self, built: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> None:
        values = torch.empty(built.shape, dtype=FP8)
        found = torch.empty(1)
        KERNEL(values, built, found)
        if self.pad:  # a kernel that pads its weight: computed from the values, not replayable
            values = torch.nn.functional.pad(values.view(torch.uint8), (0, 0)).view(FP8)
        weight.data.copy_(values.t())
        scale.data.copy_(found.expand(scale.shape) if scale.numel() > 1 else found)


def checkpoint(seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    shapes = {"q": (H, H), "k": (H, H), "v": (H, H), "o": (H, H), "norm": (H,), "embed": (VOCAB, H)}
    return [(n, torch.randn(s, generator=g).to(torch.bfloat16)) for n, s in shapes.items()]


def reloaded(named: Named) -> Engine:
    engine = Engine()
    engine.reload(named)
    return engine


def assert_same(a: Engine, b: Engine) -> None:
    for (name, x), y in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(
            x.view(torch.uint8) if x.dtype == FP8 else x, y.view(torch.uint8) if y.dtype == FP8 else y
        ), name


def test_a_replayed_fp8_refit_equals_the_reload() -> None:
    engine = Engine()
    plans = LoadPlans(engine.tensors, recorder=QuantRecorder)
    for seed, way in enumerate(["recorded", "verified", "replayed", "replayed"]):
        engine.embed.data.fill_(5.0)  # the replayed fill must zero the padding again
        named = checkpoint(seed)
        assert plans.load(named, engine.reload) == way
        assert_same(engine, reloaded(named))
    (plan,) = plans.plans.values()
    assert plan is not None
    quantizes = [s for s in plan.steps if isinstance(s, Quantize)]
    # q/k/v gathered into the scratch tensor, o read where it lies
    assert [q.direct for q in quantizes] == [False, True]


def test_a_kept_list_replays_new_values() -> None:
    """A staging buffer's views come again as the same list with new values."""
    engine = Engine()
    plans = LoadPlans(engine.tensors, recorder=QuantRecorder)
    named = checkpoint(0)
    for seed, way in enumerate(["recorded", "verified", "replayed", "replayed"]):
        for (_, t), (_, new) in zip(named, checkpoint(seed)):
            t.copy_(new)
        assert plans.load(named, engine.reload, keep=True) == way
        assert_same(engine, reloaded(named))


def test_a_reload_that_computes_on_the_values_gets_no_plan(caplog: pytest.LogCaptureFixture) -> None:
    engine = Engine(pad=True)
    plans = LoadPlans(engine.tensors, recorder=QuantRecorder)
    with caplog.at_level(logging.INFO, logger="rollgen_vllm.load_plan"):
        assert plans.load(checkpoint(0), engine.reload) == "recorded"
    assert "computed from the incoming tensors" in caplog.text
    for seed in (1, 2):
        assert plans.load(checkpoint(seed), engine.reload) == "loaded"
        assert_same(engine, reloaded(checkpoint(seed)))


def test_verification_drops_a_wrong_quantization(caplog: pytest.LogCaptureFixture) -> None:
    """A plan whose gathered slices are crossed (q's source into k's rows) fails its verification
    (the FP8 values the reload wrote differ from the plan's), and the reload's result stands."""
    engine = Engine()
    plans = LoadPlans(engine.tensors, recorder=QuantRecorder)
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
