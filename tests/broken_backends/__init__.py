"""Broken backends: copies of the hf and example backends that each break one rule of
docs/writing-a-backend.md or docs/contract.md (stand-ins, named as such), and the suite tests
that must fail them. ``tests/test_suite_mutants.py`` runs those tests against each; the table in
docs/conformance-rules.md lists them."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from rollgen import Backend, Capability, hookimpl
from rollgen_example.plugin import ExampleConfig
from rollgen_hf.config import HfConfig
from rollgen_hf.plugin import CAPABILITIES as HF_CAPABILITIES

EXAMPLE_CAPABILITIES = frozenset({Capability.LOGPROBS, Capability.REFIT_TENSORS})
#: The suite's time limit for the hanging mutants: each hang ends there (a test's set-up, an
#: engine's start included, takes 2 to 3 s of it on an idle CI machine).
HANG_TIMEOUT_S = 20
#: What the hanging mutants run under.
HANG_LIMIT = (f"--rollgen-test-timeout={HANG_TIMEOUT_S}", "--rollgen-shutdown-grace=1")


@dataclass(frozen=True)
class Mutant:
    """``cls`` (in this package) breaks ``rule``; the suite tests ``tests`` (a ``-k``
    expression) must fail it with a message holding ``says``."""

    cls: str
    base: str
    rule: str
    tests: str
    says: str
    options: tuple[str, ...] = ()
    #: Capabilities it declares beyond its base backend's.
    extra: frozenset[Capability] = frozenset()

    @property
    def name(self) -> str:
        return "broken-" + self.cls.rsplit(":", 1)[1].lower()


MUTANTS = [
    Mutant("sampling:SharedBatchGenerator", "hf", "seeds", "seed_alone", "drawn from its own seed alone"),
    Mutant(
        "sampling:ProcessedWhenRawAsked",
        "hf",
        "raw logprobs",
        "distribution",
        "raw logprobs asked (the default)",
    ),
    Mutant("sampling:RawWhenProcessedAsked", "hf", "processed logprobs", "processed_logprobs", "max |dlogp|"),
    Mutant("sampling:CutsIgnored", "hf", "top-k and top-p", "distribution", "the reference never samples it"),
    Mutant(
        "sampling:TopPDropsCrossingToken",
        "hf",
        "top-p keeps the crossing token",
        "distribution",
        "top-k then top-p",
    ),
    Mutant("sampling:TopKOffByOne", "hf", "top-k keeps k tokens", "distribution", "top-k alone (top_p 1)"),
    Mutant("sampling:TopPBeforeTopK", "hf", "top-k before top-p", "distribution", "top-k then top-p"),
    Mutant(
        "sampling:StopStringsIgnored",
        "hf",
        "stop strings",
        "stop_strings_per_sample",
        "completes its stop string",
    ),
    Mutant("engine:StopTokenNotKept", "example", "stop token ids kept", "stop_token_ids", "(kept)"),
    Mutant(
        "engine:OnlyTokenizerEos",
        "example",
        "stop at p.stop_token_ids (the model's EOS ids)",
        "stop_token_ids or generation_config_eos",
        "expected at most 3",
    ),
    Mutant(
        "engine:LogprobsSlightlyOff", "example", "logprob bounds", "reference_agreement", "above the bound"
    ),
    Mutant("engine:LogprobsFloat64", "example", "output dtypes", "output_layout", "float64"),
    Mutant(
        "engine:RefitIgnored",
        "example",
        "refit applied",
        "refit_follows_new_weights",
        "greedy tokens unchanged",
    ),
    Mutant(
        "engine:PartialRefitIntoTheNextLayer",
        "example",
        "partial refit of whole module groups",
        "partial_refit",
        "partial against complete refit",
    ),
    Mutant(
        "engine:PrefixCacheKeptAcrossRefits",
        "example",
        "no prefix cached under old weights reused",
        "refit_follows_new_weights or long_prompt_follows_a_refit",
        "greedy tokens unchanged",
    ),
    Mutant(
        "engine:SleepKeepsServing",
        "hf",
        "sleep releases what it claims",
        "sleep_wake",
        "sleep should free some",
    ),
    Mutant(
        "streaming:AbortIgnored",
        "hf",
        "_stream_abort ends samples",
        "test_cancel",
        "_stream_abort must end them",
    ),
    Mutant(
        "streaming:AbortedNeverReported",
        "hf",
        "every started sample reported once (aborted ones too)",
        "test_cancel",
        "asked to end (cancelled) but not reported",
        HANG_LIMIT,
    ),
    Mutant(
        "streaming:LosesASample",
        "hf",
        "every started sample reported once",
        "stream_equals_generate",
        "sample 0 (key",
        HANG_LIMIT,
    ),
    Mutant(
        "streaming:ReportsTwice",
        "hf",
        "every started sample reported once (not twice)",
        "stream_equals_generate",
        "that were not running",
    ),
    Mutant(
        "streaming:ProgressLogprobsOff",
        "hf",
        "the tokens reported while a sample runs are its end's",
        "streamed_tokens_are_the_results",
        "streamed logprobs",
    ),
    Mutant(
        "streaming:PrefillLosesSamples",
        "hf",
        "a failed engine step fails the samples it started",
        "update_in_flight and keep",
        "running for",
        HANG_LIMIT,
    ),
    Mutant(
        "streaming:PrefillFails",
        "hf",
        "a failed engine step fails the samples it started (followed: no hang)",
        "update_in_flight and keep",
        "failed in the engine: RuntimeError: prefill failed",
    ),
    Mutant(
        "streaming:WeightsLoadAfterPrefill",
        "hf",
        "tokens of each version from its weights (keep)",
        "update_in_flight and keep",
        "do not agree with the weights of their version",
    ),
    Mutant(
        "adapters:AdapterNotApplied",
        "hf",
        "every sample decodes with its adapter version",
        "adapter_refit_follows",
        "differ from the reference argmax",
        extra=frozenset({Capability.ADAPTERS}),
    ),
    Mutant(
        "adapters:AdapterReloadedUnderOneName",
        "hf",
        "each adapter refit is a version of its own (nothing of one serves another)",
        "adapter_refit_follows",
        "differ from the reference argmax",
        extra=frozenset({Capability.ADAPTERS}),
    ),
]


class BrokenBackends:
    """The plugin that registers every mutant (with its base backend's config and
    capabilities); the suite's engines of the hf-based ones run on the CPU."""

    @hookimpl
    def rollgen_register_backends(self, register: Callable[[Backend], None]) -> None:
        for m in MUTANTS:
            hf = m.base == "hf"
            register(
                Backend(
                    m.name,
                    f"broken_backends.{m.cls}",
                    HfConfig if hf else ExampleConfig,
                    (HF_CAPABILITIES if hf else EXAMPLE_CAPABILITIES) | m.extra,
                    description=f"stand-in: breaks {m.rule}",
                )
            )

    @hookimpl
    def rollgen_conformance_config(self, backend: str, base: Mapping[str, Any]) -> Mapping[str, Any]:
        hf = next(m for m in MUTANTS if m.name == backend).base == "hf"
        return {"hf_cfg": {"device": "cpu"}} if hf else {}
