"""Plugin discovery: entry points, isolation of broken plugins, allow/block lists."""

import ast
import json
import subprocess
import sys
from importlib.metadata import EntryPoint, distribution, entry_points
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest
from packaging.requirements import Requirement
from typer.testing import CliRunner

import rollgen
import rollgen.registry
from rollgen import BackendNotFound, BackendUnavailable, PluginError
from rollgen.cli import app
from rollgen.registry import Registry


def eps(*names: str) -> list[EntryPoint]:
    return [EntryPoint(name=n, value=f"fake_plugins.{n}", group="rollgen") for n in names]


class DistEntryPoint:
    """A fake plugin's entry point as an installed distribution (name, version) provides it."""

    def __init__(self, name: str, distribution: str, version: str) -> None:
        self.name = name
        self.dist = SimpleNamespace(name=distribution, version=version)
        self._ep = EntryPoint(name=name, value=f"fake_plugins.{name}", group="rollgen")

    def load(self) -> ModuleType:
        return self._ep.load()


ALL = ("good", "raises_on_import", "bad_capability", "bad_hook")


@pytest.fixture(autouse=True)
def _path(monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(__import__("pathlib").Path(__file__).parent))


def test_broken_plugins_are_isolated_and_reported() -> None:
    reg = Registry(eps(*ALL), env={})
    assert set(reg.backends) == {"good", "good-missing-engine"}
    status = {n: p.status for n, p in reg.plugins.items()}
    assert status == {
        "good": "ok",
        "raises_on_import": "broken",
        "bad_capability": "broken",
        "bad_hook": "broken",
    }
    assert "teleport" in str(reg.plugins["bad_capability"].error)
    assert "rollgen_no_such_hook" in str(reg.plugins["bad_hook"].error)
    with pytest.raises(BackendUnavailable, match="broken at import") as info:
        reg.get("raises_on_import")
    assert isinstance(info.value.__cause__, RuntimeError)


@pytest.fixture
def conflicting(monkeypatch: pytest.MonkeyPatch) -> Registry:
    """The process-wide registry replaced by one where plugins of two distributions both
    register a backend named 'good'."""
    reg = Registry(
        [DistEntryPoint("good", "fake-good", "1.0"), DistEntryPoint("duplicate", "fake-dup", "2.0")],
        env={},
    )
    monkeypatch.setattr(rollgen.registry, "_registry", reg)
    return reg


def test_a_name_two_plugins_register_is_used_from_neither(conflicting: Registry, hf_config: dict) -> None:
    reg = conflicting
    assert reg.plugins["good"].status == reg.plugins["duplicate"].status == "ok", "neither plugin is broken"
    assert set(reg.backends) == {"good-missing-engine"}, "the plugins' other backends stay usable"
    with pytest.raises(PluginError) as info:
        reg.get("good")
    message = str(info.value)
    for part in (
        "plugin 'good' (fake-good 1.0)",
        "plugin 'duplicate' (fake-dup 2.0)",
        "ROLLGEN_DISABLE_PLUGINS",
    ):
        assert part in message, f"{part!r} missing from the conflict error: {message}"
    with pytest.raises(PluginError, match="fake-dup"):
        rollgen.create_generation({**hf_config, "backend": "good"})


def test_cli_backends_shows_the_conflict(conflicting: Registry) -> None:
    result = CliRunner().invoke(app, ["backends", "--json"])
    assert result.exit_code == 0, result.output
    rows = [r for r in json.loads(result.output) if r["name"] == "good"]
    assert [(r["plugin"], r["distribution"], r["status"]) for r in rows] == [
        ("good", "fake-good", "conflict"),
        ("duplicate", "fake-dup", "conflict"),
    ]
    assert all("fake-good" in r["reason"] and "fake-dup" in r["reason"] for r in rows), rows


def test_conformance_hooks_answer_for_their_own_backends_only() -> None:
    reg = Registry(eps("good", "hooks"), env={})
    config = reg.backend_hook("hooks-b", "rollgen_conformance_config", base={"seed": 0})
    assert config == {"asked_for": "hooks-b", "base_keys": ["seed"]}, "the plugin is told which backend"
    assert reg.backend_hook("hooks-a", "rollgen_conformance_known_failures") == {
        "test_empty_batch": "claimed broken on hooks-a"
    }
    # 'hooks' answers any request: asked about 'good' (whose plugin has no such hooks) it is not called
    assert reg.backend_hook("good", "rollgen_conformance_config", base={}) is None
    assert reg.backend_hook("good", "rollgen_conformance_known_failures") is None
    with pytest.raises(BackendNotFound, match="no-such"):
        reg.backend_hook("no-such", "rollgen_conformance_known_failures")


def test_missing_engine_is_unavailable_with_hint() -> None:
    entry = Registry(eps("good"), env={}).get("good-missing-engine")
    assert not entry.available
    with pytest.raises(BackendUnavailable, match="pip install no-such-engine"):
        entry.load_factory()


def test_allow_and_block_lists() -> None:
    reg = Registry(eps(*ALL), env={"ROLLGEN_PLUGINS": "good"})
    assert reg.plugins["raises_on_import"].status == "disabled"
    assert set(reg.backends) == {"good", "good-missing-engine"}
    reg = Registry(eps("good", "raises_on_import"), env={"ROLLGEN_DISABLE_PLUGINS": "good,raises_on_import"})
    assert "good" not in reg.backends
    with pytest.raises(BackendNotFound, match="disabled"):
        reg.get("good")


def test_builtin_backends_come_from_entry_points_without_engine_imports() -> None:
    """Discovery through the installed entry points imports no engine, Ray or model code (the
    Ray backends' config types subclass ``rollgen.distributed.config.RayEngineCfg``)."""
    code = (
        "import sys, json; from rollgen.registry import get_registry; r = get_registry();"
        "heavy = ('vllm', 'sglang', 'ray', 'transformers.models');"
        "print(json.dumps({'backends': sorted(r.backends),"
        " 'loaded': [m for m in heavy if m in sys.modules]}))"
    )
    out = json.loads(
        subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    )
    assert {"hf", "example"} <= set(out["backends"])
    assert out["loaded"] == []


#: Each first-party plugin (entry point name) and the distribution of plugins/ that provides it.
FIRST_PARTY = {
    "hf": "rollgen-hf",
    "vllm": "rollgen-vllm",
    "sglang": "rollgen-sglang",
    "remote": "rollgen-remote",
}
ROOT = Path(__file__).resolve().parents[1]


def test_first_party_backends_are_distributions_of_their_own() -> None:
    """Our backends are built, installed and found as a third party's: each entry point in group
    'rollgen' comes from the backend's own distribution (plugins/<x>_backend/pyproject.toml); the
    core distribution declares none, and each backend distribution depends on this core's series."""
    found = {ep.name: ep.dist.name for ep in entry_points(group="rollgen") if ep.name in FIRST_PARTY}
    assert found == FIRST_PARTY
    assert [ep.name for ep in distribution("rollgen").entry_points if ep.group == "rollgen"] == []
    for name in FIRST_PARTY.values():
        core = [r for r in map(Requirement, distribution(name).requires or []) if r.name == "rollgen"]
        assert any(r.marker is None for r in core), f"{name} does not require the core: {core}"
        for r in core:
            assert r.specifier.contains(rollgen.__version__) and not r.specifier.contains("0.2"), (name, r)


def test_the_core_imports_no_backend() -> None:
    """No module of core/rollgen imports a backend's package, at module level or inside a function:
    the core reaches backends through the registry alone."""
    plugins = {p.name for p in ROOT.glob("plugins/*/rollgen_*")} | {"rollgen_example"}
    assert {"rollgen_hf", "rollgen_vllm", "rollgen_sglang", "rollgen_remote"} <= plugins
    found = []
    for path in sorted((ROOT / "core" / "rollgen").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            where = f"{path.relative_to(ROOT)}:{node.lineno}"
            found += [f"{where} {n}" for n in names if n.split(".")[0] in plugins]
    assert found == []


def test_cli_backends_json(cli_backends: dict) -> None:
    rows = cli_backends
    assert rows["hf"]["importable"]
    assert "refit_tensors" in rows["hf"]["capabilities"]
    assert {name: row["distribution"] for name, row in rows.items()} == {
        "hf": "rollgen-hf",
        "hf-ray": "rollgen-hf",
        "vllm": "rollgen-vllm",
        "sglang": "rollgen-sglang",
        "remote": "rollgen-remote",
        "example": "rollgen-example",
    }
