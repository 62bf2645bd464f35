"""Adapters (``adapters``): a LoRA adapter refitted alone serves the merged model's outputs, each
refit is a version of its own (no KV or cached prefix of one serves another), a bad adapter
changes nothing, and samples in flight finish on their version under ``keep``."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import pytest
import torch

from rollgen.conformance.checks import (
    assert_same_generation,
    check_against_reference,
    raises,
    requires,
    skip_unless,
)
from rollgen.conformance.pool import FAILED, EnginePool
from rollgen.errors import RefitError
from rollgen.refit.adapters import AdapterSpec
from rollgen.spec import Capability
from rollgen.testing.reference import merged_reference, random_adapter

#: The LoRA setup of the adapter tests' engines: every projection, rank 4.
LORA = {"rank": 4, "alpha": 8.0, "max_versions": 3}
#: The adapter tests' engine dtype, and the bound their outputs are held to: float32, except on
#: GPUs, where engines' LoRA kernels take half precision only (vLLM's Triton ones assert it).
ADAPTER_DTYPE = "bfloat16" if torch.cuda.is_available() else "float32"


def same_generation(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return torch.equal(a["output_ids"], b["output_ids"]) and torch.allclose(a["logprobs"], b["logprobs"])


class AdapterTests:
    """Adapter refits, on an engine with the config's ``lora`` that these tests share (each
    begins with an adapter refit of its own)."""

    @pytest.fixture
    def lora_engine(
        self,
        request: pytest.FixtureRequest,
        engine_pool: EnginePool,
        caps: frozenset[Capability],
        make_engine: Callable[..., Any],
    ) -> Iterator[Any]:
        skip_unless(caps, "adapters", lambda: make_engine(lora=LORA, dtype=ADAPTER_DTYPE))
        yield engine_pool.variant(lora=LORA, dtype=ADAPTER_DTYPE)
        if request.node.stash.get(FAILED, False):
            engine_pool.release_variant()

    @requires("adapters")
    def test_adapter_refit_follows_the_merged_model(
        self,
        request: pytest.FixtureRequest,
        lora_engine: Any,
        references: Callable[[str, str], Any],
        model_dir: str,
        batch: dict[str, torch.Tensor],
    ) -> None:
        """Before any adapter the model alone; after one, the merged model's tokens and
        logprobs; another adapter on the same prompts follows its own tensors (an engine that
        kept the KV or the prefix cache of the first under the same name would not: vLLM
        #42125); refitting the first again gives its outputs back."""
        engine = lora_engine
        spec = AdapterSpec.of(LORA, engine.weight_spec)
        first, second = random_adapter(spec, seed=1), random_adapter(spec, seed=2)
        alone = None
        if engine.weight_version == 0:  # the first test on this engine: the model alone
            alone = engine.generate(batch, greedy=True)
            check_against_reference(references(model_dir, ADAPTER_DTYPE), alone, batch, ADAPTER_DTYPE)
        outs = {}
        for label, adapter in (("first", first), ("second", second)):
            engine.refit(adapter, target="adapter")
            outs[label] = engine.generate(batch, greedy=True)
            stats = check_against_reference(
                merged_reference(model_dir, adapter, spec, getattr(torch, ADAPTER_DTYPE)),
                outs[label],
                batch,
                ADAPTER_DTYPE,
            )
            for k, v in stats.items():
                request.node.user_properties.append((f"{label}_adapter_{k}", v))
        assert alone is None or not same_generation(outs["first"], alone), (
            "an adapter refit left the outputs unchanged"
        )
        assert not same_generation(outs["second"], outs["first"]), (
            "a second adapter on the same prompts gave the first one's outputs (KV or prefixes kept "
            "across adapter versions?)"
        )
        engine.refit(first, target="adapter")
        assert_same_generation(
            request, "first_adapter_again", engine.generate(batch, greedy=True), outs["first"]
        )

    @requires("adapters")
    def test_bad_adapter_rejected(
        self,
        request: pytest.FixtureRequest,
        lora_engine: Any,
        batch: dict[str, torch.Tensor],
    ) -> None:
        """A missing, unknown, misshapen, NaN or infinite tensor, a partial update or something
        that is no adapter is a RefitError naming the culprit, and the previous adapter serves on."""
        engine = lora_engine
        spec = AdapterSpec.of(LORA, engine.weight_spec)
        good = random_adapter(spec, seed=1)
        engine.refit(good, target="adapter")
        served = engine.generate(batch, greedy=True)
        version = engine.weight_version
        name = next(iter(good))
        cases = {
            "missing tensor": (name, {k: v for k, v in good.items() if k != name}),
            "unknown tensor": (
                "base_model.model.x.lora_A.weight",
                {**good, "base_model.model.x.lora_A.weight": good[name]},
            ),
            "wrong shape": (name, {**good, name: good[name][:, :-1]}),
            "NaN tensor": (name, {**good, name: torch.full_like(good[name], float("nan"))}),
            "infinite tensor": (name, {**good, name: torch.full_like(good[name], float("inf"))}),
        }
        for label, (culprit, adapter) in cases.items():
            error = raises(
                RefitError, f"adapter refit with a {label}", partial(engine.refit, adapter, target="adapter")
            )
            assert culprit in str(error), (
                f"adapter refit with a {label}: the RefitError does not name {culprit!r}: {error}"
            )
        raises(
            RefitError, "a partial adapter refit", partial(engine.refit, good, target="adapter", partial=True)
        )
        raises(
            RefitError, "an adapter refit of a list", partial(engine.refit, [good[name]], target="adapter")
        )
        assert engine.weight_version == version, "a rejected adapter refit counted as an update"
        assert_same_generation(
            request, "after_rejected_adapters", engine.generate(batch, greedy=True), served
        )

    @requires("adapters", "async")
    @pytest.mark.parametrize("mode", ["keep", "wait"])
    def test_adapter_update_in_flight(
        self,
        mode: str,
        lora_engine: Any,
        caps: frozenset[Capability],
        batch: dict[str, torch.Tensor],
    ) -> None:
        """Samples submitted before an adapter refit finish on their version, in one segment, with
        the tokens their adapter gives (``keep``: the engine holds both versions meanwhile;
        ``wait``: the refit waits for them); samples after it use the new one."""
        engine = lora_engine
        skip_unless(caps, "async", lambda: engine.submit(batch))
        spec = AdapterSpec.of(LORA, engine.weight_spec)
        first, second = random_adapter(spec, seed=1), random_adapter(spec, seed=2)
        want = {}
        for label, adapter in (("second", second), ("first", first)):
            engine.refit(adapter, target="adapter")
            want[label] = engine.generate(batch, greedy=True)
        version = engine.weight_version
        rollout = engine.submit(batch, greedy=True)
        engine.refit(second, target="adapter", mode=mode)
        after = engine.submit(batch, greedy=True)
        for results, label, stamp in (
            (rollout.wait(), "first", version),
            (after.wait(), "second", version + 1),
        ):
            for r in results:
                assert r.versions == ((stamp, 0),), (
                    f"{mode}: sample {r.index}, submitted under version {stamp}, has segments {r.versions}"
                )
                n = int(want[label]["generation_lengths"][r.index])
                start = int(batch["input_lengths"][r.index])
                expected = want[label]["output_ids"][r.index, start : start + n].tolist()
                assert list(r.token_ids) == expected, (
                    f"{mode}: sample {r.index} (the {label} adapter's) made {list(r.token_ids)}, its adapter "
                    f"gives {expected}"
                )
