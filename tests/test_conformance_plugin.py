"""The conformance plugin itself: known failures are strict xfails; the JSON report."""

import json

import pytest

import rollgen.registry
from rollgen import Backend, Capability, GenerationConfig, hookimpl
from rollgen.registry import PluginRecord, Registry
from rollgen.testing.tiny_model import cache_root

pytest_plugins = ["pytester"]


class KnownFailures:
    """A plugin whose backend (the example engine under another name) (wrongly) lists a passing
    test as a known failure."""

    @hookimpl
    def rollgen_register_backends(self, register):
        caps = frozenset({Capability.LOGPROBS, Capability.REFIT_TENSORS})
        register(Backend("claims", "rollgen_example.engine:ExampleGeneration", GenerationConfig, caps))

    @hookimpl
    def rollgen_conformance_known_failures(self, backend: str):
        return {"test_empty_batch": f"claimed broken on {backend}"}


@pytest.fixture(scope="session")
def rollgen_cache() -> str:
    """The tiny models' cache, found before pytester points HOME elsewhere (where they would be
    built again, which takes minutes)."""
    return str(cache_root())


@pytest.fixture
def known_failures(monkeypatch: pytest.MonkeyPatch, rollgen_cache: str) -> None:
    """The installed plugins and ``KnownFailures``, as the process-wide registry."""
    monkeypatch.setenv("ROLLGEN_CACHE_DIR", rollgen_cache)
    registry = Registry()
    registry.add_plugin(KnownFailures(), PluginRecord("known-failures", "rollgen-claims", "0.1"))
    monkeypatch.setattr(rollgen.registry, "_registry", registry)


def test_known_failure_that_passes_fails_the_run(pytester: pytest.Pytester, known_failures, tmp_path) -> None:
    report = tmp_path / "report.json"
    # the report is rewritten after every test: a run stopped from outside leaves what ran
    pytester.makeconftest(
        f"""
import json, pathlib
def pytest_runtest_setup(item):
    if "test_empty_batch" in item.name:
        seen = json.loads(pathlib.Path({str(report)!r}).read_text())
        assert [t["test"].split("::")[-1] for t in seen["tests"]] == ["test_registration"]
"""
    )
    result = pytester.runpytest_inprocess(
        "-p",
        "rollgen.conformance",
        "--pyargs",
        "rollgen.conformance.suite",
        "--rollgen-backend=claims",
        f"--rollgen-report={report}",
        "-k",
        "test_empty_batch or test_registration",
    )
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*XPASS(strict)*claimed broken on claims*"])
    data = json.loads(report.read_text())
    assert data["header"]["backend"] == "claims" and data["header"]["distribution"] == "rollgen-claims"
    assert data["header"]["spec_version"] == 1 and "logprobs" in data["header"]["capabilities"]
    assert {t["outcome"] for t in data["tests"]} == {"passed", "failed"}
    failed = next(t for t in data["tests"] if t["outcome"] == "failed")
    assert "claimed broken" in failed["error"], "a failure's text is in the report"
