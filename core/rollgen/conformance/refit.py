"""Refit: outputs follow pushed weights exactly; bad updates are rejected before anything changes."""

from __future__ import annotations

import threading
from collections.abc import Callable
from functools import partial
from typing import Any

import pytest
import torch

import rollgen
from rollgen.conformance.checks import (
    assert_same_generation,
    assert_same_tokens,
    check_against_reference,
    raises,
    requires,
    rows_where,
    skip_unless,
)
from rollgen.errors import RefitError, StaleWeights
from rollgen.output import generated_mask
from rollgen.refit import device_uuid
from rollgen.spec import Capability
from rollgen.testing.faults import Unreadable
from rollgen.testing.trainer import start_trainer

#: Tokens of the context ``test_a_long_prompt_follows_a_refit`` leaves to generate in.
LONG_PROMPT_ROOM = 16


def long_prompt(tokenizer: Any, length: int) -> dict[str, torch.Tensor]:
    """One prompt of ``length`` tokens: a count, from 1 on."""
    ids: list[int] = []
    n = 1
    while len(ids) < length:
        ids += tokenizer(f" {n}", add_special_tokens=False)["input_ids"]
        n += 1
    return {"input_ids": torch.tensor([ids[:length]]), "input_lengths": torch.tensor([length])}


class RefitTests:
    """Refits of the shared engine, which ends each test on its original weights."""

    @requires("refit")
    def test_refit_follows_new_weights(
        self,
        request: pytest.FixtureRequest,
        engine: Any,
        caps: frozenset[Capability],
        references: Callable[[str, str], Any],
        model_dir: str,
        other_model_dir: str,
        batch: dict[str, torch.Tensor],
        greedy_out: dict[str, torch.Tensor],
    ) -> None:
        new = references(other_model_dir, "float32")
        skip_unless(caps, "refit", lambda: engine.refit(new))
        old = references(model_dir, "float32")
        # twice, in the same buckets: an engine that caches how it loads a layout reuses it
        for label in ("", "second_"):
            engine.refit(new, bucket_bytes=64 << 10, dtype=engine.engine_dtype)
            try:
                out = engine.generate(batch, greedy=True)
                assert not torch.equal(out["output_ids"], greedy_out["output_ids"]), (
                    f"{label}refit to other weights: greedy tokens unchanged {out['output_ids'].tolist()}"
                )
                stats = check_against_reference(new, out, batch, "float32")
                for k, v in stats.items():
                    request.node.user_properties.append((f"after_{label}refit_{k}", v))
            finally:
                buckets = rollgen.iter_buckets(
                    old, engine.local_transport, bucket_bytes=64 << 10, dtype=engine.engine_dtype
                )
                engine.update_weights(list(buckets))
            restored = engine.generate(batch, greedy=True)
            assert_same_generation(request, f"{label}restored", restored, greedy_out)

    @requires("refit")
    def test_a_long_prompt_follows_a_refit(
        self,
        request: pytest.FixtureRequest,
        engine: Any,
        caps: frozenset[Capability],
        references: Callable[[str, str], Any],
        model_dir: str,
        other_model_dir: str,
        tokenizer: Any,
    ) -> None:
        """A prompt that fills most of the context, so that an engine's prefix cache holds whole
        blocks of it (vLLM's are 16 tokens on a GPU, 128 on a CPU), generated before a refit
        and again after it: the second follows the new weights (no prefix cached under the old
        ones is reused, whether the engine resets its cache or keys it by weight version), and
        the first weights give the first output back."""
        new = references(other_model_dir, "float32")
        dtype = engine.engine_dtype
        skip_unless(caps, "refit", lambda: engine.refit(new, dtype=dtype))
        old = references(model_dir, "float32")
        long = long_prompt(tokenizer, engine.max_model_len - LONG_PROMPT_ROOM)
        before = engine.generate(long, greedy=True)
        engine.refit(new, dtype=dtype)
        try:
            after = engine.generate(long, greedy=True)
            stats = check_against_reference(new, after, long, "float32")
            request.node.user_properties += [(f"long_prompt_after_refit_{k}", v) for k, v in stats.items()]
        finally:
            engine.refit(old, dtype=dtype)
        assert_same_generation(request, "long_prompt_restored", engine.generate(long, greedy=True), before)

    @requires("refit")
    def test_bad_refit_rejected(
        self,
        engine: Any,
        caps: frozenset[Capability],
        references: Callable[[str, str], Any],
        other_model_dir: str,
        batch: dict[str, torch.Tensor],
        greedy_out: dict[str, torch.Tensor],
    ) -> None:
        good = {
            k: v.to(engine.engine_dtype)
            for k, v in references(other_model_dir, "float32").state_dict().items()
        }
        skip_unless(caps, "refit", lambda: engine.refit(good))
        name = "model.norm.weight"
        bad_cases = {
            "unknown name": (
                "model.not_a_layer.weight",
                {**good, "model.not_a_layer.weight": torch.zeros(3)},
            ),
            "wrong shape": (
                name,
                {**good, name: torch.zeros(good[name].shape[0] + 1, dtype=engine.engine_dtype)},
            ),
            "wrong dtype": (name, {**good, name: good[name].to(torch.float16)}),
        }
        missing = "lm_head.weight" if "lm_head.weight" not in engine.weight_spec.tied else name
        bad_cases.update(
            {
                "missing tensor": (missing, {k: v for k, v in good.items() if k != missing}),
                "NaN tensor": (name, {**good, name: torch.full_like(good[name], float("nan"))}),
                "infinite tensor": (name, {**good, name: torch.full_like(good[name], float("inf"))}),
                "half a fused group": (
                    "model.layers.0.self_attn.k_proj.weight",
                    {
                        "model.layers.0.self_attn.q_proj.weight": good[
                            "model.layers.0.self_attn.q_proj.weight"
                        ]
                    },
                ),
            }
        )
        for label, (culprit, sd) in bad_cases.items():
            call = partial(engine.refit, sd, partial=label == "half a fused group")
            error = raises(RefitError, f"refit with a {label}", call)
            assert culprit in str(error), (
                f"refit with a {label}: the RefitError does not name {culprit!r}: {error}"
            )
        for label, source in {"None": None, "a list": [good[name]], "an int bucket size": good}.items():
            size = 0 if label == "an int bucket size" else None
            raises(RefitError, f"refit of {label}", partial(engine.refit, source, bucket_bytes=size))
        raises(RefitError, "update_weights(None)", partial(engine.update_weights, None))
        out = engine.generate(batch, greedy=True)
        assert_same_tokens(
            "after the rejected refits (the old weights serve)", out["output_ids"], greedy_out["output_ids"]
        )

    @requires("refit")
    def test_partial_refit_of_whole_module_groups(
        self,
        request: pytest.FixtureRequest,
        engine: Any,
        caps: frozenset[Capability],
        references: Callable[[str, str], Any],
        model_dir: str,
        other_model_dir: str,
        batch: dict[str, torch.Tensor],
        greedy_out: dict[str, torch.Tensor],
    ) -> None:
        """``partial=True`` with whole module groups (every tensor of the first layer's MLP,
        which engines fuse): the engine serves exactly the mix, as after a complete refit of the
        mixed weights (the complete refit itself is held to the HF reference above)."""
        other = references(other_model_dir, "float32").state_dict()
        group = {k: v for k, v in other.items() if k.startswith("model.layers.0.mlp.")}
        skip_unless(caps, "refit", partial(engine.refit, group, partial=True))
        mixed = {**references(model_dir, "float32").state_dict(), **group}
        engine.refit(group, partial=True, dtype=engine.engine_dtype)
        try:
            after_partial = engine.generate(batch, greedy=True)
            engine.refit(mixed, dtype=engine.engine_dtype)
            after_complete = engine.generate(batch, greedy=True)
            assert_same_generation(request, "partial against complete refit", after_partial, after_complete)
        finally:
            engine.refit(references(model_dir, "float32"), dtype=engine.engine_dtype)
        restored = engine.generate(batch, greedy=True)
        assert_same_tokens(
            "after refitting the original weights", restored["output_ids"], greedy_out["output_ids"]
        )

    @requires("refit")
    def test_a_refit_that_fails_part_way_makes_the_engine_refuse_until_a_complete_refit(
        self,
        engine: Any,
        caps: frozenset[Capability],
        references: Callable[[str, str], Any],
        model_dir: str,
        batch: dict[str, torch.Tensor],
        greedy_out: dict[str, torch.Tensor],
    ) -> None:
        """The last bucket holds a tensor that cannot be read (``rollgen.testing.faults``, a
        stand-in: names, shapes and dtypes pass; packing or loading it fails), after earlier
        buckets reached the engine: generate raises StaleWeights until a complete refit, which
        restores the outputs."""
        state = {
            k: v.to(engine.engine_dtype) for k, v in references(model_dir, "float32").state_dict().items()
        }
        last = list(state)[-1]
        broken = {**state, last: state[last].clone().as_subclass(Unreadable)}
        skip_unless(caps, "refit", lambda: engine.refit(state))
        with pytest.raises(Exception):  # noqa: B017 - whatever the engine raises on an unreadable tensor
            engine.refit(broken, bucket_bytes=64 << 10, check_finite=False)
        raises(StaleWeights, "generate after a refit that failed part-way", partial(engine.generate, batch))
        engine.refit(state)
        out = engine.generate(batch, greedy=True)
        assert_same_tokens("after a complete refit", out["output_ids"], greedy_out["output_ids"])

    @requires("refit")
    def test_a_good_refit_restores_an_engine_that_served_nan_weights(
        self,
        engine: Any,
        caps: frozenset[Capability],
        references: Callable[[str, str], Any],
        model_dir: str,
        batch: dict[str, torch.Tensor],
        greedy_out: dict[str, torch.Tensor],
    ) -> None:
        """NaN weights pushed on purpose (``check_finite=False``) and served once; then the good
        weights: every later sample is finite and greedy outputs are the original ones (NaN keys
        and values cached under the bad weights must not leak into later attention)."""
        good = {
            k: v.to(engine.engine_dtype) for k, v in references(model_dir, "float32").state_dict().items()
        }
        nan = {k: torch.full_like(v, float("nan")) for k, v in good.items()}
        skip_unless(caps, "refit", lambda: engine.refit(good))
        engine.refit(nan, check_finite=False)
        engine.generate(batch, greedy=True)
        engine.refit(good)
        for attempt in range(3):
            out = engine.generate(batch)
            mask = generated_mask(out, batch["input_lengths"])
            bad = rows_where(~torch.isfinite(out["logprobs"]) & mask)
            assert not bad, (
                f"sampled generate {attempt} after the good refit: non-finite logprobs in rows {bad}"
            )
        restored = engine.generate(batch, greedy=True)
        assert_same_tokens("greedy after the good refit", restored["output_ids"], greedy_out["output_ids"])

    @requires("refit")
    def test_a_refit_from_another_thread_waits_for_a_running_generate(
        self,
        engine: Any,
        caps: frozenset[Capability],
        references: Callable[[str, str], Any],
        model_dir: str,
        other_model_dir: str,
        batch: dict[str, torch.Tensor],
        greedy_out: dict[str, torch.Tensor],
    ) -> None:
        """Calls on one generation object from several threads run one at a time: a generate
        running while another thread refits sees the old weights or the new, never a mix."""
        old, new = references(model_dir, "float32"), references(other_model_dir, "float32")
        skip_unless(caps, "refit", lambda: engine.refit(new))
        try:
            engine.refit(new, dtype=engine.engine_dtype)
            with_new = engine.generate(batch, greedy=True)["output_ids"]
            engine.refit(old, dtype=engine.engine_dtype)
            results: list[torch.Tensor] = []
            thread = threading.Thread(
                target=lambda: results.append(engine.generate(batch, greedy=True)["output_ids"])
            )
            thread.start()
            engine.refit(new, dtype=engine.engine_dtype)
            thread.join()
            assert results, "the generate in the other thread raised"
            mixed = not (
                torch.equal(results[0], greedy_out["output_ids"]) or torch.equal(results[0], with_new)
            )
            assert not mixed, f"a generate during a refit mixed two weights: {results[0].tolist()}"
        finally:
            engine.refit(old, dtype=engine.engine_dtype)

    @requires("refit_collective")
    def test_refit_collective(
        self,
        request: pytest.FixtureRequest,
        engine: Any,
        caps: frozenset[Capability],
        references: Callable[[str, str], Any],
        model_dir: str,
        other_model_dir: str,
        batch: dict[str, torch.Tensor],
        greedy_out: dict[str, torch.Tensor],
    ) -> None:
        """A trainer in a process of its own joins a weight-sync group with every engine rank
        and broadcasts the other weights (logprobs then agree with an HF reference of them),
        then an update missing a tensor (rejected on both sides, nothing applied), then the
        original weights (the original outputs exactly)."""
        skip_unless(
            caps,
            "refit_collective",
            lambda: engine.weight_sync_spec("127.0.0.1"),
        )
        # the trainer on a GPU of its own over NCCL where there is one (NCCL takes one rank per
        # GPU), else on CPU over gloo
        free = [
            i for i in range(torch.cuda.device_count()) if device_uuid(i) not in engine.updates.facts.devices
        ]
        backend, device = ("nccl", f"cuda:{free[0]}") if free else ("gloo", "cpu")
        spec = engine.weight_sync_spec("127.0.0.1", backend=backend, timeout_s=120)
        dtype = str(engine.engine_dtype).removeprefix("torch.")
        updates = [(other_model_dir, None), (other_model_dir, "model.norm.weight"), (model_dir, None)]
        trainer = start_trainer(spec, updates, dtype, device)
        try:
            engine.init_weight_sync(trainer.spec)
            engine.update_weights_from_collective()
            assert trainer.result() == "ok", "the trainer's first send failed"
            out = engine.generate(batch, greedy=True)
            stats = check_against_reference(references(other_model_dir, "float32"), out, batch, "float32")
            for k, v in stats.items():
                request.node.user_properties.append((f"after_collective_refit_{k}", v))
            error = raises(RefitError, "an update missing a tensor", engine.update_weights_from_collective)
            assert "model.norm.weight" in str(error) and not error.stale, str(error)
            assert trainer.result().startswith("RefitError"), "the trainer's bad send did not raise"
            unchanged = engine.generate(batch, greedy=True)
            assert_same_tokens("after a rejected update", unchanged["output_ids"], out["output_ids"])
            engine.update_weights_from_collective()
            assert trainer.result() == "ok", "the trainer's last send failed"
            assert trainer.wait() == 0
        finally:
            trainer.kill()
        restored = engine.generate(batch, greedy=True)
        assert_same_generation(request, "restored_over_the_group", restored, greedy_out)
