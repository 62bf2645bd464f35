"""The conformance plugin itself: known failures are strict xfails; the JSON report; the
capability gate; the run fails at once for a backend that cannot run, unless allowed."""

import json

import pytest

import rollgen.registry
from rollgen import Backend, Capability, GenerationConfig, hookimpl
from rollgen.registry import PluginRecord, Registry

pytest_plugins = ["pytester"]

EXAMPLE_ENGINE = "rollgen_example.engine:ExampleGeneration"
SUITE = ("-p", "rollgen.conformance", "--pyargs", "rollgen.conformance.suite")


class SuiteBackends:
    """Backends for these runs: the example engine under other names ('claims' (wrongly) lists a
    passing test as a known failure; 'bare' declares logprobs only), one whose engine is not
    installed, and 'twin', which ``Twin`` registers too."""

    @hookimpl
    def rollgen_register_backends(self, register):
        logprobs = frozenset({Capability.LOGPROBS})
        register(Backend("claims", EXAMPLE_ENGINE, GenerationConfig, logprobs | {Capability.REFIT_TENSORS}))
        register(Backend("bare", EXAMPLE_ENGINE, GenerationConfig, logprobs))
        register(
            Backend(
                "missing-engine",
                "no_such_engine_pkg.x:Y",
                GenerationConfig,
                logprobs,
                requires=("no_such_engine_pkg",),
                install_hint="pip install no-such-engine",
            )
        )
        register(Backend("twin", EXAMPLE_ENGINE, GenerationConfig, logprobs))

    @hookimpl
    def rollgen_conformance_known_failures(self, backend: str):
        return {"test_empty_batch": f"claimed broken on {backend}"} if backend == "claims" else None


class Twin:
    @hookimpl
    def rollgen_register_backends(self, register):
        register(Backend("twin", EXAMPLE_ENGINE, GenerationConfig, frozenset({Capability.LOGPROBS})))


class Broken:
    @hookimpl
    def rollgen_register_backends(self, register):
        raise RuntimeError("this plugin is broken at registration")


#: Counts in a run's summary that are no test's outcome: tests left out by ``-k``, and warnings
#: (pytest warns that it cannot rewrite the asserts of ``rollgen.conformance`` once a test before
#: this file has imported it).
NOT_OUTCOMES = {"deselected", "warnings"}


@pytest.fixture
def suite(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, prepared: str) -> pytest.Pytester:
    """pytester, with the installed plugins and those above as the process-wide registry."""
    monkeypatch.setenv("ROLLGEN_CACHE_DIR", prepared)
    registry = Registry()
    registry.add_plugin(SuiteBackends(), PluginRecord("suite-backends", "rollgen-suite-backends", "0.1"))
    registry.add_plugin(Twin(), PluginRecord("twin-plugin", "rollgen-twin", "0.2"))
    registry.add_plugin(Broken(), PluginRecord("broken", "rollgen-broken", "0.3"))
    monkeypatch.setattr(rollgen.registry, "_registry", registry)
    return pytester


def test_known_failure_that_passes_fails_the_run(suite: pytest.Pytester, tmp_path) -> None:
    report = tmp_path / "report.json"
    # the report is rewritten after every test: a run stopped from outside leaves what ran
    suite.makeconftest(
        f"""
import json, pathlib
def pytest_runtest_setup(item):
    if "test_empty_batch" in item.name:
        seen = json.loads(pathlib.Path({str(report)!r}).read_text())
        assert [t["test"].split("::")[-1] for t in seen["tests"]] == ["test_registration"]
        assert seen["running"] == "TestConformance::test_empty_batch", seen["running"]
"""
    )
    result = suite.runpytest_inprocess(
        *SUITE,
        "--rollgen-backend=claims",
        f"--rollgen-report={report}",
        "-k",
        "test_empty_batch or test_registration",
    )
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*XPASS(strict)*claimed broken on claims*"])
    data = json.loads(report.read_text())
    assert data["header"]["backend"] == "claims"
    assert data["header"]["distribution"] == "rollgen-suite-backends"
    assert data["header"]["spec_version"] == 1 and "logprobs" in data["header"]["capabilities"]
    assert data["running"] is None, "no test runs once the run ended"
    assert {t["outcome"] for t in data["tests"]} == {"passed", "failed"}
    failed = next(t for t in data["tests"] if t["outcome"] == "failed")
    assert "claimed broken" in failed["error"], "a failure's text is in the report"


def test_undeclared_capabilities_are_asserted_then_skipped(suite: pytest.Pytester, tmp_path) -> None:
    """'bare' declares no refit and no text path: each gate checks the UnsupportedCapability; the
    skip names the area and the test, and the report lists what each test requires."""
    report = tmp_path / "report.json"
    result = suite.runpytest_inprocess(
        *SUITE, "--rollgen-backend=bare", "-rs", f"--rollgen-report={report}", "-k", "refit or text_path"
    )
    outcomes = result.parseoutcomes()
    assert set(outcomes) - NOT_OUTCOMES == {"skipped"} and outcomes["skipped"] >= 3, outcomes
    result.stdout.fnmatch_lines(
        [
            "*OutputContractTests::test_text_path: text not declared (UnsupportedCapability asserted)*",
            "*RefitTests::test_refit_follows_new_weights: refit (refit_ipc or refit_tensors) not declared*",
        ]
    )
    tests = {t["test"].split("::")[-1]: t for t in json.loads(report.read_text())["tests"]}
    assert tests["test_text_path"]["details"]["requires"] == ["text"], tests["test_text_path"]
    assert tests["test_text_path"]["reason"].endswith("text not declared (UnsupportedCapability asserted)")


def test_capability_gates_are_markers_at_collection(suite: pytest.Pytester) -> None:
    """``-m requires_<name>`` selects the gated tests without running them: every streaming test
    (its area's ``__requires__``), and each test marked ``requires``; the areas run in
    ``BackendConformance.areas`` order whatever the bases' order."""
    from rollgen.conformance.base import AREAS

    def collected(*args: str) -> list[str]:
        result = suite.runpytest_inprocess(*SUITE, "--rollgen-backend=bare", "--collect-only", "-q", *args)
        return [line.rsplit("::", 1)[1] for line in result.stdout.lines if "::" in line]

    assert collected("-m", "requires_async") == [
        "test_stream_equals_generate",
        "test_streamed_tokens_are_the_results",
        "test_cancel",
        "test_update_in_flight[keep]",
        "test_update_in_flight[abort]",
        "test_update_in_flight[wait]",
        "test_adapter_update_in_flight[keep]",
        "test_adapter_update_in_flight[wait]",
    ]
    assert collected("-m", "requires_text") == ["test_text_path"]
    every = collected()
    order = [a for a in AREAS for name in every if name.split("[")[0] in vars(a)]
    assert order == sorted(order, key=AREAS.index), "the tests run area by area, in AREAS order"
    assert every[0] == "test_registration" and every[-1] == "test_broken_model_folders_are_config_errors"


@pytest.mark.parametrize(
    ("backend", "why"),
    [
        ("no-such", "no rollgen backend named 'no-such'"),
        ("missing-engine", "missing no_such_engine_pkg); install it with: pip install no-such-engine"),
        (
            "twin",
            "plugin 'suite-backends' (rollgen-suite-backends 0.1) and plugin 'twin-plugin' "
            "(rollgen-twin 0.2)",
        ),
        ("broken", "plugin 'broken' (rollgen-broken 0.3) is broken: this plugin is broken at registration"),
    ],
)
def test_a_backend_that_cannot_run_fails_the_run_in_one_line(
    suite: pytest.Pytester, tmp_path, backend: str, why: str
) -> None:
    report = tmp_path / "report.json"
    result = suite.runpytest_inprocess(*SUITE, f"--rollgen-backend={backend}", f"--rollgen-report={report}")
    assert result.ret == pytest.ExitCode.USAGE_ERROR, f"exit {result.ret}, expected a usage error"
    errors = [line for line in result.stderr.lines if line.strip()]
    assert len(errors) == 1, f"expected one line on stderr, got {errors}"
    assert errors[0].startswith("ERROR: rollgen conformance: ") and why in errors[0], errors[0]
    assert "--rollgen-allow-unavailable" in errors[0], errors[0]
    data = json.loads(report.read_text())
    assert data["tests"] == [], f"no test should run: {data['tests']}"
    assert data["error"] == errors[0].removeprefix("ERROR: "), "the report says why"


def test_allow_unavailable_reports_the_tests_skipped(suite: pytest.Pytester) -> None:
    result = suite.runpytest_inprocess(
        *SUITE, "--rollgen-backend=missing-engine", "--rollgen-allow-unavailable", "-rs"
    )
    assert result.ret == pytest.ExitCode.OK, f"exit {result.ret}"
    outcomes = result.parseoutcomes()
    assert set(outcomes) - NOT_OUTCOMES == {"skipped"} and outcomes["skipped"] >= 21, (
        f"every test skipped: {outcomes}"
    )
    result.stdout.fnmatch_lines(
        ["*unavailable here: *missing no_such_engine_pkg*pip install no-such-engine*"]
    )


def test_rollgen_config_must_be_a_json_object(suite: pytest.Pytester) -> None:
    result = suite.runpytest_inprocess(*SUITE, "--rollgen-backend=bare", "--rollgen-config={not json")
    assert result.ret == pytest.ExitCode.USAGE_ERROR, f"exit {result.ret}"
    result.stderr.fnmatch_lines(["ERROR: --rollgen-config is not valid JSON: *"])


def test_after_a_failed_test_the_next_one_gets_a_new_shared_engine(suite: pytest.Pytester) -> None:
    """A test that failed may have broken the engine the tests share in a way nobody can see:
    the next test that asks for it gets a new one (a test that passed leaves it shared)."""
    suite.makepyfile(
        test_pool="""
from rollgen.conformance.base import BackendConformance

class TestPool(BackendConformance):
    def test_a_marks_the_engine_and_passes(self, engine):
        engine.marked = "a"

    def test_b_gets_it_marks_it_and_fails(self, engine):
        assert engine.marked == "a"
        engine.marked = "b"
        assert False, "failed on purpose"

    def test_c_gets_a_new_engine(self, engine):
        assert engine.usable and not hasattr(engine, "marked")
"""
    )
    result = suite.runpytest_inprocess(
        "-p",
        "rollgen.conformance",
        "--rollgen-backend=bare",
        "test_pool.py",
        "-k",
        "the_engine_and_passes or marks_it_and_fails or gets_a_new_engine",
    )
    result.assert_outcomes(passed=2, failed=1)
