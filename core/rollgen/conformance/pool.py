"""The engines of one conformance test class."""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch

import rollgen
from rollgen.config import deep_merge
from rollgen.conformance.time_limit import ENGINES

#: Set in a test item's stash when its call failed, or failed as a known failure.
FAILED = pytest.StashKey[bool]()


class EnginePool:
    """The engines of one test class: the shared one (made when first asked for, remade if it
    was released or a worker of it died), a variant of it with config overrides that the tests
    asking for the same ones share (the adapter tests' engine with ``lora``; replaced by a test's
    own engine), and those a test makes (shut down when the test ends). With ``one_engine``, a
    test's engine first releases every other, so one engine holds the devices at a time: for
    layouts that take all of them (TP=2 or DP=2 on two GPUs)."""

    def __init__(
        self, base_config: dict[str, Any], one_engine: bool = False, shutdown_grace_s: float | None = None
    ) -> None:
        self.base_config, self.one_engine, self.shutdown_grace_s = base_config, one_engine, shutdown_grace_s
        self.greedy_out: dict[str, torch.Tensor] | None = None
        self._shared: Any = None
        self._variant: tuple[dict[str, Any], Any] | None = None
        self._made: list[Any] = []

    def shared(self) -> Any:
        if self._shared is not None and not getattr(self._shared, "usable", True):
            self.release_shared()  # a test killed it: the next one gets a new engine
        if self._shared is None:
            if self.one_engine:
                self.end_test()
                self.release_variant()
            self._shared = self._create(self.base_config)
        return self._shared

    def variant(self, **overrides: Any) -> Any:
        """The engine of ``overrides``, shared by the tests that ask for the same ones."""
        if self._variant is not None and (
            self._variant[0] != overrides or not getattr(self._variant[1], "usable", True)
        ):
            self.release_variant()
        if self._variant is None:
            if self.one_engine:
                self.end_test()
                self.release_shared()
            self._variant = (overrides, self._create(deep_merge(self.base_config, overrides)))
        return self._variant[1]

    def make(self, **overrides: Any) -> Any:
        self.release_variant()
        if self.one_engine:
            self.end_test()
            self.release_shared()
        engine = self._create(deep_merge(self.base_config, overrides))
        self._made.append(engine)
        return engine

    def _create(self, config: dict[str, Any]) -> Any:
        engine = rollgen.create_generation(config)
        if self.shutdown_grace_s is not None:
            engine.shutdown_grace_s = self.shutdown_grace_s
        ENGINES.add(engine)
        return engine

    def end_test(self) -> None:
        while self._made:
            self._made.pop().shutdown()
        gc.collect()

    def release_variant(self) -> None:
        """Shut the variant engine down (the next test that asks for it gets a new one)."""
        if self._variant is not None:
            engine = self._variant[1]
            self._variant = None
            engine.shutdown()

    def release_shared(self) -> None:
        """Shut the shared engine down (the next test that asks for it gets a new one)."""
        if self._shared is not None:
            self._shared, engine = None, self._shared
            engine.shutdown()

    def close(self) -> None:
        self.release_variant()
        self.release_shared()
        self.end_test()
