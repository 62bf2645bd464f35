"""The conformance plugin itself: known failures are strict xfails; the JSON report."""

import json

import pytest

from rollgen import hookimpl
from rollgen.registry import PluginRecord, get_registry

pytest_plugins = ["pytester"]


class KnownFailures:
    """A plugin that (wrongly) lists a passing test as a known failure of ``example``."""

    @hookimpl
    def rollgen_conformance_known_failures(self, backend: str):
        return {"test_empty_batch": "claimed broken"} if backend == "example" else None


@pytest.fixture
def known_failures():
    plugin = KnownFailures()
    registry = get_registry()
    registry.add_plugin(plugin, PluginRecord("known-failures", None, None))
    yield
    registry.pm.unregister(plugin)
    del registry.plugins["known-failures"]


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
        "--rollgen-backend=example",
        f"--rollgen-report={report}",
        "-k",
        "test_empty_batch or test_registration",
    )
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*XPASS(strict)*claimed broken*"])
    data = json.loads(report.read_text())
    assert data["header"]["backend"] == "example" and data["header"]["distribution"] == "rollgen-example"
    assert data["header"]["spec_version"] == 1 and "logprobs" in data["header"]["capabilities"]
    assert {t["outcome"] for t in data["tests"]} == {"passed", "failed"}
    failed = next(t for t in data["tests"] if t["outcome"] == "failed")
    assert "claimed broken" in failed["error"], "a failure's text is in the report"
