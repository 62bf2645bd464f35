"""The suite's fixtures: the backend under test, its config, its engines, the reference models
and the prompts. Class-scoped ones are classmethods (pytest deprecates instance methods there)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import pytest
import torch

from rollgen.config import deep_merge
from rollgen.conformance.pool import FAILED, EnginePool
from rollgen.errors import RollgenError
from rollgen.registry import RegisteredBackend, get_registry
from rollgen.spec import Capability
from rollgen.testing.config import tiny_config
from rollgen.testing.prompts import PROMPTS, encode
from rollgen.testing.reference import load_reference_model
from rollgen.testing.tiny_model import tiny_model_dir


def usable_backend(name: str) -> RegisteredBackend:
    """Backend ``name``, its engine's factory imported. Raises what stands in the way:
    BackendNotFound, PluginError (a name two plugins register), BackendUnavailable (a broken
    plugin, an engine that is missing or fails to import)."""
    entry = get_registry().get(name)
    entry.load_factory()
    return entry


class ConformanceFixtures:
    """What every area of the suite uses; override any fixture in a subclass (class-scoped ones
    as classmethods)."""

    backend_name: ClassVar[str | None] = None
    max_new_tokens: ClassVar[int] = 12

    @pytest.fixture(scope="class")
    @classmethod
    def backend(cls, request: pytest.FixtureRequest) -> RegisteredBackend:
        name = cls.backend_name or request.config.getoption("--rollgen-backend", default=None)
        if not name:
            pytest.fail("no backend given: pass --rollgen-backend=NAME or set backend_name")
        try:
            return usable_backend(name)
        except RollgenError as exc:
            if request.config.getoption("--rollgen-allow-unavailable", default=False):
                pytest.skip(f"unavailable here: {exc}")
            pytest.fail(f"backend {name!r} cannot be tested: {exc}", pytrace=False)

    @pytest.fixture(scope="class")
    @classmethod
    def caps(cls, backend: RegisteredBackend) -> frozenset[Capability]:
        return backend.backend.capabilities

    @pytest.fixture(scope="class")
    @classmethod
    def model_dir(cls) -> str:
        return tiny_model_dir()

    @pytest.fixture(scope="class")
    @classmethod
    def other_model_dir(cls) -> str:
        """Same architecture, different (untrained) weights: the refit target."""
        return tiny_model_dir(trained=False)

    @pytest.fixture(scope="class")
    @classmethod
    def tokenizer(cls, model_dir: str) -> Any:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(model_dir)

    @pytest.fixture(scope="class")
    @classmethod
    def base_config(
        cls, request: pytest.FixtureRequest, backend: RegisteredBackend, model_dir: str
    ) -> dict[str, Any]:
        """The tiny model's config, then the backend's conformance hook, then --rollgen-config."""
        name = backend.backend.name
        cfg = tiny_config(name, model_dir, max_new_tokens=cls.max_new_tokens, dtype="float32", seed=1234)
        extra = get_registry().backend_hook(name, "rollgen_conformance_config", base=cfg)
        cfg = deep_merge(cfg, extra) if extra else cfg
        cli = request.config.getoption("--rollgen-config", default=None)
        return deep_merge(cfg, json.loads(cli)) if cli else cfg

    @pytest.fixture(scope="class")
    @classmethod
    def engine_pool(cls, request: pytest.FixtureRequest, base_config: dict[str, Any]) -> Iterator[EnginePool]:
        pool = EnginePool(
            base_config,
            one_engine=bool(request.config.getoption("--rollgen-one-engine", False)),
            shutdown_grace_s=request.config.getoption("--rollgen-shutdown-grace", None),
        )
        yield pool
        pool.close()

    @pytest.fixture
    def make_engine(self, engine_pool: EnginePool) -> Iterator[Callable[..., Any]]:
        """Engines a test makes (config overrides as keywords), shut down when the test ends or
        sooner as context managers: ``with make_engine(seed=7) as engine:``."""
        yield engine_pool.make
        engine_pool.end_test()

    @pytest.fixture
    def engine(self, request: pytest.FixtureRequest, engine_pool: EnginePool) -> Iterator[Any]:
        """The engine most tests share (made when first needed; after a test that failed, or
        failed as a known failure, the next test gets a new one: that test may have broken it)."""
        yield engine_pool.shared()
        if request.node.stash.get(FAILED, False):
            engine_pool.release_shared()

    @pytest.fixture(scope="class")
    @classmethod
    def references(cls) -> Callable[[str, str], Any]:
        """HF reference models by (model folder, dtype), each loaded once."""
        cache: dict[tuple[str, str], Any] = {}

        def get(model_dir: str, dtype: str) -> Any:
            if (model_dir, dtype) not in cache:
                cache[(model_dir, dtype)] = load_reference_model(model_dir, getattr(torch, dtype))
            return cache[(model_dir, dtype)]

        return get

    @pytest.fixture(scope="class")
    @classmethod
    def batch(cls, tokenizer: Any) -> dict[str, torch.Tensor]:
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
