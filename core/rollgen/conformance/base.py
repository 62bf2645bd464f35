"""``BackendConformance``: the whole contract as pytest tests. Subclass it to give a backend
custom fixtures (override ``backend_name``, ``base_config``, ``engine`` (the engine most tests
share) or ``make_engine`` (engines one test makes, shut down when it ends)). At most two engines
are alive at once (the shared one and a test's own), or one with ``--rollgen-one-engine``."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import pytest
import torch

import rollgen
from rollgen.config import deep_merge
from rollgen.conformance.checks import (
    assert_same_generation,
    can_refit,
    check_against_reference,
    device_memory_used,
    fp32_bound,
)
from rollgen.conformance.pool import EnginePool
from rollgen.errors import (
    EngineAsleep,
    EngineClosed,
    InputError,
    RefitError,
    UnsupportedCapability,
)
from rollgen.registry import RegisteredBackend, get_registry
from rollgen.spec import Capability
from rollgen.testing.config import tiny_config
from rollgen.testing.prompts import PROMPTS, encode, generated_texts
from rollgen.testing.reference import agreement, generated_mask, load_reference_model, teacher_forced_logprobs
from rollgen.testing.tiny_model import tiny_model_dir, with_generation_config


class BackendConformance:
    """The contract. Set ``backend_name`` in a subclass, or pass ``--rollgen-backend``."""

    backend_name: ClassVar[str | None] = None
    max_new_tokens: ClassVar[int] = 12

    # ---- fixtures ------------------------------------------------------------------------------
    @pytest.fixture(scope="class")
    def backend(self, request: pytest.FixtureRequest) -> RegisteredBackend:
        name = self.backend_name or request.config.getoption("--rollgen-backend", default=None)
        if not name:
            pytest.fail("no backend given: pass --rollgen-backend=NAME or set backend_name")
        entry = get_registry().get(name)
        if not entry.available:
            pytest.skip(f"backend {name!r} unavailable here: {entry.unavailable_reason()}")
        return entry

    @pytest.fixture(scope="class")
    def caps(self, backend: RegisteredBackend) -> frozenset[Capability]:
        return backend.backend.capabilities

    @pytest.fixture(scope="class")
    def model_dir(self) -> str:
        return tiny_model_dir()

    @pytest.fixture(scope="class")
    def other_model_dir(self) -> str:
        """Same architecture, different (untrained) weights: the refit target."""
        return tiny_model_dir(trained=False)

    @pytest.fixture(scope="class")
    def tokenizer(self, model_dir: str) -> Any:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(model_dir)

    @pytest.fixture(scope="class")
    def base_config(
        self, request: pytest.FixtureRequest, backend: RegisteredBackend, model_dir: str
    ) -> dict[str, Any]:
        """The tiny model's config, then the backend's conformance hook, then --rollgen-config."""
        name = backend.backend.name
        cfg = tiny_config(name, model_dir, max_new_tokens=self.max_new_tokens, dtype="float32", seed=1234)
        extra = get_registry().backend_hook(name, "rollgen_conformance_config", base=cfg)
        cfg = deep_merge(cfg, extra) if extra else cfg
        cli = request.config.getoption("--rollgen-config", default=None)
        return deep_merge(cfg, json.loads(cli)) if cli else cfg

    @pytest.fixture(scope="class")
    def engine_pool(
        self, request: pytest.FixtureRequest, base_config: dict[str, Any]
    ) -> Iterator[EnginePool]:
        pool = EnginePool(
            base_config, one_engine=bool(request.config.getoption("--rollgen-one-engine", False))
        )
        yield pool
        pool.close()

    @pytest.fixture
    def make_engine(self, engine_pool: EnginePool) -> Iterator[Callable[..., Any]]:
        """Engines a test makes (config overrides as keywords), shut down when the test ends."""
        yield engine_pool.make
        engine_pool.end_test()

    @pytest.fixture
    def engine(self, engine_pool: EnginePool) -> Any:
        """The engine most tests share (made when first needed)."""
        return engine_pool.shared()

    @pytest.fixture(scope="class")
    def references(self) -> Callable[[str, str], Any]:
        cache: dict[tuple[str, str], Any] = {}

        def get(model_dir: str, dtype: str) -> Any:
            if (model_dir, dtype) not in cache:
                cache[(model_dir, dtype)] = load_reference_model(model_dir, getattr(torch, dtype))
            return cache[(model_dir, dtype)]

        return get

    @pytest.fixture(scope="class")
    def batch(self, tokenizer: Any) -> dict[str, torch.Tensor]:
        return encode(tokenizer, PROMPTS)

    @pytest.fixture
    def greedy_out(
        self, request: pytest.FixtureRequest, engine_pool: EnginePool, batch: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """The shared engine's first greedy output, kept for the class (asking for the engine only
        the first time, so a released shared engine is not remade just for this)."""
        if engine_pool.greedy_out is None:
            engine_pool.greedy_out = request.getfixturevalue("engine").generate(batch, greedy=True)
        return engine_pool.greedy_out

    # ---- registration --------------------------------------------------------------------------
    def test_registration(self, backend: RegisteredBackend) -> None:
        b = backend.backend
        assert all(isinstance(c, Capability) for c in b.capabilities)
        assert Capability.LOGPROBS in b.capabilities, "every backend must return logprobs"
        assert backend.plugin.status == "ok"

    # ---- output contract -----------------------------------------------------------------------
    def test_output_layout(
        self, greedy_out: dict[str, torch.Tensor], batch: dict[str, torch.Tensor], base_config: dict[str, Any]
    ) -> None:
        out, pad = greedy_out, base_config["pad_token_id"]
        ids, lengths = batch["input_ids"], batch["input_lengths"]
        assert set(out) >= {"output_ids", "logprobs", "generation_lengths", "unpadded_sequence_lengths"}
        assert out["output_ids"].dtype == torch.long and out["logprobs"].dtype == torch.float32
        assert out["generation_lengths"].dtype == torch.long
        assert out["unpadded_sequence_lengths"].dtype == torch.long
        gen = out["generation_lengths"]
        width = ids.shape[1] + int(gen.max())
        assert out["output_ids"].shape == out["logprobs"].shape == (ids.shape[0], width)
        assert torch.equal(out["unpadded_sequence_lengths"], lengths + gen)
        assert (gen >= 1).all() and (gen <= base_config["max_new_tokens"]).all()
        positions = torch.arange(width).unsqueeze(0)
        prompt = positions < lengths.unsqueeze(1)
        tail = positions >= out["unpadded_sequence_lengths"].unsqueeze(1)
        padded_input = torch.full((ids.shape[0], width), pad)
        padded_input[:, : ids.shape[1]] = ids
        assert torch.equal(out["output_ids"][prompt], padded_input[prompt])
        assert (out["output_ids"][tail] == pad).all()
        assert (out["logprobs"][prompt | tail] == 0).all()
        generated = ~(prompt | tail)
        assert torch.isfinite(out["logprobs"][generated]).all()
        assert (out["logprobs"][generated] <= 0).all()

    def test_eos_ends_generation(
        self,
        greedy_out: dict[str, torch.Tensor],
        batch: dict[str, torch.Tensor],
        tokenizer: Any,
        base_config: dict[str, Any],
    ) -> None:
        out = greedy_out
        ended = out["generation_lengths"] < base_config["max_new_tokens"]
        assert ended.any(), "the tiny model should end some lines with EOS within the budget"
        last = out["output_ids"].gather(1, (out["unpadded_sequence_lengths"] - 1).unsqueeze(1)).squeeze(1)
        assert (last[ended] == tokenizer.eos_token_id).all()

    def test_empty_batch(self, engine: Any) -> None:
        out = engine.generate(
            {
                "input_ids": torch.zeros((0, 4), dtype=torch.long),
                "input_lengths": torch.zeros(0, dtype=torch.long),
            }
        )
        assert out["output_ids"].shape[0] == 0 and out["output_ids"].dtype == torch.long
        assert out["logprobs"].shape[0] == 0 and out["logprobs"].dtype == torch.float32
        assert out["generation_lengths"].shape == (0,)

    def test_single_sample_and_padding_width(
        self, engine: Any, tokenizer: Any, greedy_out: dict[str, torch.Tensor], base_config: dict[str, Any]
    ) -> None:
        """Extra right padding and batch composition do not change greedy tokens."""
        one = encode(tokenizer, PROMPTS[:1], extra_pad=5)
        out = engine.generate(one, greedy=True)
        n = int(out["unpadded_sequence_lengths"][0])
        assert torch.equal(out["output_ids"][0, :n], greedy_out["output_ids"][0, :n])

    def test_context_limit(self, engine: Any, tokenizer: Any) -> None:
        limit = engine.max_model_len
        ids = torch.full((1, limit - 2), tokenizer.convert_tokens_to_ids("a"), dtype=torch.long)
        out = engine.generate({"input_ids": ids, "input_lengths": torch.tensor([limit - 2])}, greedy=True)
        assert int(out["unpadded_sequence_lengths"][0]) <= limit

    # ---- determinism ---------------------------------------------------------------------------
    def test_greedy_determinism(
        self,
        request: pytest.FixtureRequest,
        engine: Any,
        batch: dict[str, torch.Tensor],
        greedy_out: dict[str, torch.Tensor],
    ) -> None:
        again = engine.generate(batch, greedy=True)
        assert_same_generation(request, "repeat", again, greedy_out)

    # ---- per-sample settings ---------------------------------------------------------------------
    def test_per_sample_sampling(
        self,
        engine: Any,
        caps: frozenset[Capability],
        tokenizer: Any,
        greedy_out: dict[str, torch.Tensor],
        batch: dict[str, torch.Tensor],
    ) -> None:
        data = dict(batch)
        data["temperature"] = torch.tensor([0.0, 1.0, 0.0, 1.0, 0.0])
        data["max_new_tokens"] = torch.tensor([2, 5, 12, 12, 3])
        data["seed"] = torch.tensor([1, 2, 3, 4, 5])
        if Capability.PER_SAMPLE_SAMPLING not in caps:
            with pytest.raises(UnsupportedCapability):
                engine.generate(data)
            pytest.skip("per_sample_sampling not declared (UnsupportedCapability asserted)")
        out = engine.generate(data)
        assert (out["generation_lengths"] <= data["max_new_tokens"]).all()
        for i in (0, 2, 4):  # temperature 0 rows are greedy
            n = int(out["unpadded_sequence_lengths"][i])
            assert torch.equal(out["output_ids"][i, :n], greedy_out["output_ids"][i, :n])
        again = engine.generate(data)
        assert torch.equal(again["output_ids"], out["output_ids"]), "per-sample seeds reproduce"

    def test_stop_strings_per_sample(
        self,
        engine: Any,
        caps: frozenset[Capability],
        tokenizer: Any,
        batch: dict[str, torch.Tensor],
        greedy_out: dict[str, torch.Tensor],
    ) -> None:
        texts = generated_texts(tokenizer, greedy_out, batch)
        stop = texts[0].strip().split(" ")[1] if len(texts[0].split()) > 1 else None
        assert stop, f"the tiny model's greedy output {texts[0]!r} is too short for this test"
        data = dict(batch, stop_strings=[[stop], None, ["never-seen"], None, None])
        if Capability.STOP_STRINGS not in caps:
            with pytest.raises(UnsupportedCapability):
                engine.generate(data, greedy=True)
            pytest.skip("stop_strings not declared (UnsupportedCapability asserted)")
        out = engine.generate(data, greedy=True)
        base_len = greedy_out["generation_lengths"]
        ids0 = greedy_out["output_ids"][0]
        start = int(batch["input_lengths"][0])
        expected = next(
            k
            for k in range(1, int(base_len[0]) + 1)
            if stop in tokenizer.decode(ids0[start : start + k].tolist())
        )
        assert int(out["generation_lengths"][0]) == expected, "sample 0 stops where its string ends"
        assert torch.equal(out["generation_lengths"][1:], base_len[1:]), "others are untouched"

    def test_text_path(
        self,
        engine: Any,
        caps: frozenset[Capability],
        tokenizer: Any,
        batch: dict[str, torch.Tensor],
        greedy_out: dict[str, torch.Tensor],
    ) -> None:
        data = {"prompts": PROMPTS}
        if Capability.TEXT not in caps:
            with pytest.raises(UnsupportedCapability):
                engine.generate_text(data, greedy=True)
            pytest.skip("text not declared (UnsupportedCapability asserted)")
        texts = engine.generate_text(data, greedy=True)["texts"]
        assert texts == generated_texts(tokenizer, greedy_out, batch, skip_special=True)
        assert engine.generate_text({"prompts": []})["texts"] == []

    # ---- refit ---------------------------------------------------------------------------------
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
        if not can_refit(caps):
            with pytest.raises(UnsupportedCapability):
                engine.refit(new.state_dict())
            pytest.skip("no refit capability declared (UnsupportedCapability asserted)")
        old = references(model_dir, "float32")
        # twice, in the same buckets: an engine that caches how it loads a layout reuses it
        for label in ("", "second_"):
            engine.refit(new, bucket_bytes=64 << 10, dtype=engine.engine_dtype)
            try:
                out = engine.generate(batch, greedy=True)
                assert not torch.equal(out["output_ids"], greedy_out["output_ids"])
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
        name = "model.norm.weight"
        bad_cases = {
            "unknown name": {**good, "model.not_a_layer.weight": torch.zeros(3)},
            "wrong shape": {**good, name: torch.zeros(good[name].shape[0] + 1, dtype=engine.engine_dtype)},
            "wrong dtype": {**good, name: good[name].to(torch.float16)},
        }
        if not can_refit(caps):
            pytest.skip("no refit capability declared")
        for label, sd in bad_cases.items():
            with pytest.raises(RefitError) as info:
                engine.refit(sd)
            assert name in str(info.value) or "not_a_layer" in str(info.value), label
        out = engine.generate(batch, greedy=True)
        assert torch.equal(out["output_ids"], greedy_out["output_ids"]), "old weights still serve"

    # ---- sleep / wake --------------------------------------------------------------------------
    def test_sleep_wake(
        self,
        engine: Any,
        caps: frozenset[Capability],
        references: Callable[[str, str], Any],
        model_dir: str,
        batch: dict[str, torch.Tensor],
        greedy_out: dict[str, torch.Tensor],
    ) -> None:
        if Capability.SLEEP_WAKE not in caps:
            with pytest.raises(UnsupportedCapability):
                engine.finish_generation()
            pytest.skip("sleep_wake not declared (UnsupportedCapability asserted)")
        before = device_memory_used()
        engine.finish_generation()
        engine.finish_generation()  # idempotent
        if engine.releases_memory_on_sleep:
            assert device_memory_used() < before, "sleep should release device memory"
        with pytest.raises(EngineAsleep):
            engine.generate(batch, greedy=True)
        engine.prepare_for_generation(tags=["weights"])
        if can_refit(caps):  # the staged refit pattern: weights up, refit, then cache
            engine.refit(references(model_dir, "float32"), dtype=engine.engine_dtype)
        engine.prepare_for_generation(tags=["kv_cache"])
        engine.prepare_for_generation()  # idempotent
        out = engine.generate(batch, greedy=True)
        assert torch.equal(out["output_ids"], greedy_out["output_ids"])

    # ---- bad input -----------------------------------------------------------------------------
    def test_bad_inputs_raise_and_engine_survives(
        self,
        engine: Any,
        batch: dict[str, torch.Tensor],
        greedy_out: dict[str, torch.Tensor],
        base_config: dict[str, Any],
    ) -> None:
        pad = base_config["pad_token_id"]
        ids, lengths = batch["input_ids"], batch["input_lengths"]
        left = ids.clone()
        n = int(lengths[1])
        left[1] = pad
        left[1, ids.shape[1] - n :] = ids[1, :n]
        cases: dict[str, tuple[dict[str, Any], list[int] | None]] = {
            "left padded": ({"input_ids": left, "input_lengths": lengths}, [1]),
            "length too large": (
                {"input_ids": ids, "input_lengths": lengths.clone().index_fill_(0, torch.tensor([2]), 99)},
                [2],
            ),
            "zero length": (
                {"input_ids": ids, "input_lengths": lengths.clone().index_fill_(0, torch.tensor([3]), 0)},
                [3],
            ),
            "wrong dtype": ({"input_ids": ids.int(), "input_lengths": lengths}, None),
            "wrong shape": ({"input_ids": ids[0], "input_lengths": lengths}, None),
            "too long for context": (
                {
                    "input_ids": torch.ones((1, engine.max_model_len + 1), dtype=torch.long),
                    "input_lengths": torch.tensor([engine.max_model_len + 1]),
                },
                [0],
            ),
            "bad stop_strings": ({**batch, "stop_strings": [None, "x", None, None, None]}, [1]),
        }
        for label, (data, samples) in cases.items():
            with pytest.raises(InputError) as info:
                engine.generate(data, greedy=True)
            if samples is not None:
                assert info.value.samples == samples, label
        out = engine.generate(batch, greedy=True)
        assert torch.equal(out["output_ids"], greedy_out["output_ids"]), "engine still usable"

    # ---- tests that make their own engines (last, so the shared one is not remade for them) -----
    @pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
    def test_reference_agreement(
        self,
        request: pytest.FixtureRequest,
        dtype: str,
        make_engine: Callable[..., Any],
        greedy_out: dict[str, torch.Tensor],
        references: Callable[[str, str], Any],
        model_dir: str,
        batch: dict[str, torch.Tensor],
    ) -> None:
        if dtype == "float32":
            out = greedy_out
        else:
            eng = make_engine(dtype=dtype)
            try:
                out = eng.generate(batch, greedy=True)
            finally:
                eng.shutdown()
        stats = check_against_reference(references(model_dir, dtype), out, batch, dtype)
        for k, v in stats.items():
            request.node.user_properties.append((k, v))

    def test_seeded_reproducibility(
        self, make_engine: Callable[..., Any], batch: dict[str, torch.Tensor]
    ) -> None:
        """Two fresh engines with the same seed give the same samples, call after call (one
        engine at a time)."""
        runs = []
        for _ in range(2):
            eng = make_engine(seed=7)
            try:
                runs.append([eng.generate(batch)["output_ids"] for _ in range(2)])
            finally:
                eng.shutdown()
        (first_a, second_a), (first_b, second_b) = runs
        assert torch.equal(first_a, first_b) and torch.equal(second_a, second_b)
        assert not torch.equal(first_a, second_a), "successive calls should draw new samples"

    def test_stop_token_ids(
        self,
        make_engine: Callable[..., Any],
        batch: dict[str, torch.Tensor],
        greedy_out: dict[str, torch.Tensor],
    ) -> None:
        start = int(batch["input_lengths"][1])
        stop_id = int(greedy_out["output_ids"][1, start + 2])
        engine = make_engine(stop_token_ids=[stop_id])
        try:
            out = engine.generate(batch, greedy=True)
        finally:
            engine.shutdown()
        assert int(out["generation_lengths"][1]) <= 3
        end = int(out["unpadded_sequence_lengths"][1])
        assert int(out["output_ids"][1, end - 1]) == stop_id, "the stop token is kept"

    def test_generation_config_eos_ends_generation(
        self,
        make_engine: Callable[..., Any],
        batch: dict[str, torch.Tensor],
        greedy_out: dict[str, torch.Tensor],
        model_dir: str,
        tokenizer: Any,
        tmp_path_factory: pytest.TempPathFactory,
    ) -> None:
        """Every id of the model's ``generation_config.json`` ``eos_token_id`` ends a sample (as
        in HF's ``generate``), not only the tokenizer's EOS."""
        start = int(batch["input_lengths"][1])
        eos_id = int(greedy_out["output_ids"][1, start + 2])
        variant = with_generation_config(
            model_dir, tmp_path_factory.mktemp("eos-model"), eos_token_id=[tokenizer.eos_token_id, eos_id]
        )
        engine = make_engine(model_name=variant)
        try:
            out = engine.generate(batch, greedy=True)
        finally:
            engine.shutdown()
        assert int(out["generation_lengths"][1]) <= 3, "the generation config's EOS did not end it"
        end = int(out["unpadded_sequence_lengths"][1])
        assert int(out["output_ids"][1, end - 1]) == eos_id, "the EOS token is kept"

    def test_processed_logprobs(
        self,
        request: pytest.FixtureRequest,
        make_engine: Callable[..., Any],
        caps: frozenset[Capability],
        references: Callable[[str, str], Any],
        model_dir: str,
        batch: dict[str, torch.Tensor],
    ) -> None:
        """``logprobs_mode="processed"``: logprobs of the tempered distribution that was sampled."""
        overrides = {"logprobs_mode": "processed", "temperature": 0.7}
        if Capability.PROCESSED_LOGPROBS not in caps:
            with pytest.raises(UnsupportedCapability):
                make_engine(**overrides)
            pytest.skip("processed_logprobs not declared (UnsupportedCapability asserted)")
        engine = make_engine(**overrides)
        try:
            out = engine.generate(batch)
        finally:
            engine.shutdown()
        lengths = batch["input_lengths"]
        ref = teacher_forced_logprobs(
            references(model_dir, "float32"),
            out["output_ids"],
            lengths,
            out["unpadded_sequence_lengths"],
            0.7,
        )
        stats = agreement(out["logprobs"], ref, generated_mask(out, lengths))
        request.node.user_properties.extend(stats.items())
        assert stats["max_abs"] <= fp32_bound()["max_abs"], stats

    # ---- lifecycle -----------------------------------------------------------------------------
    def test_shutdown_idempotent(
        self, make_engine: Callable[..., Any], batch: dict[str, torch.Tensor]
    ) -> None:
        with make_engine() as engine:
            engine.generate(batch, greedy=True)
        engine.shutdown()
        with pytest.raises(EngineClosed):
            engine.generate(batch, greedy=True)
