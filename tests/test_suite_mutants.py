"""Mutation testing of the conformance suite: for each broken backend of ``broken_backends``
(a copy of hf or the example backend that breaks one stated rule), the suite tests that hold
that rule fail it, with a message that names what is broken; the backends that hang fail within
the suite's time limit, naming the samples never reported. One in-process run of the suite
(pytester) per backend, with only those tests selected."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from broken_backends import HANG_LIMIT, HANG_TIMEOUT_S, MUTANTS, BrokenBackends, Mutant

import rollgen.registry
from rollgen.registry import PluginRecord, Registry

pytest_plugins = ["pytester"]

SUITE = ("-p", "rollgen.conformance", "--pyargs", "rollgen.conformance.suite", "-p", "no:cacheprovider")


@pytest.fixture
def suite(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, prepared: str) -> pytest.Pytester:
    """pytester, with the installed plugins and the broken backends as the process-wide registry."""
    monkeypatch.setenv("ROLLGEN_CACHE_DIR", prepared)
    registry = Registry()
    registry.add_plugin(BrokenBackends(), PluginRecord("broken-backends", "rollgen-broken-backends", "0.1"))
    monkeypatch.setattr(rollgen.registry, "_registry", registry)
    return pytester


@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: m.name.removeprefix("broken-"))
def test_the_suite_fails_a_backend_that_breaks_a_rule(
    suite: pytest.Pytester, tmp_path: Path, mutant: Mutant
) -> None:
    report = tmp_path / "report.json"
    result = suite.runpytest_inprocess(
        *SUITE,
        f"--rollgen-backend={mutant.name}",
        f"--rollgen-report={report}",
        "-k",
        mutant.tests,
        *mutant.options,
    )
    outcomes = result.parseoutcomes()
    text = result.stdout.str()
    assert outcomes.get("failed", 0) + outcomes.get("errors", 0) >= 1, (
        f"the suite ({mutant.tests}) passed {mutant.name}, which breaks {mutant.rule}: {outcomes}"
    )
    assert mutant.says in text, f"no failure of {mutant.name} says {mutant.says!r}:\n{text[-4000:]}"
    if mutant.options == HANG_LIMIT:  # failed at the limit, in the report too
        failed = [t for t in json.loads(report.read_text())["tests"] if t["outcome"] == "failed"]
        assert failed and f"ran past --rollgen-test-timeout={HANG_TIMEOUT_S} s" in failed[0]["error"], failed
        assert mutant.says in failed[0]["error"], failed[0]["error"]


def test_the_docs_table_names_every_broken_backend() -> None:
    table = (Path(__file__).resolve().parents[1] / "docs" / "conformance-rules.md").read_text()
    named = set(re.findall(r"`((?:sampling|engine|streaming|adapters)\.\w+)`", table))
    assert named == {m.cls.replace(":", ".") for m in MUTANTS}, "docs/conformance-rules.md's table"
