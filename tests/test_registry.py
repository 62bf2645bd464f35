"""Plugin discovery: entry points, isolation of broken plugins, allow/block lists."""

import json
import subprocess
import sys
from importlib.metadata import EntryPoint

import pytest

from rollgen import BackendNotFound, BackendUnavailable
from rollgen.registry import Registry


def eps(*names: str) -> list[EntryPoint]:
    return [EntryPoint(name=n, value=f"fake_plugins.{n}", group="rollgen") for n in names]


ALL = ("good", "raises_on_import", "duplicate", "bad_capability", "bad_hook")


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
        "duplicate": "broken",
        "bad_capability": "broken",
        "bad_hook": "broken",
    }
    assert "already registered by plugin 'good'" in str(reg.plugins["duplicate"].error)
    assert "teleport" in str(reg.plugins["bad_capability"].error)
    assert "rollgen_no_such_hook" in str(reg.plugins["bad_hook"].error)
    with pytest.raises(BackendUnavailable, match="broken at import") as info:
        reg.get("raises_on_import")
    assert isinstance(info.value.__cause__, RuntimeError)


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
    """Discovery through the installed entry points imports no engine or model code."""
    code = (
        "import sys, json; from rollgen.registry import get_registry; r = get_registry();"
        "heavy = ('vllm', 'sglang', 'transformers.models');"
        "print(json.dumps({'backends': sorted(r.backends),"
        " 'loaded': [m for m in heavy if m in sys.modules]}))"
    )
    out = json.loads(
        subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    )
    assert {"hf", "example"} <= set(out["backends"])
    assert out["loaded"] == []


def test_cli_backends_json(cli_backends: dict) -> None:
    rows = cli_backends
    assert rows["hf"]["importable"] and rows["hf"]["distribution"] == "rollgen"
    assert "refit_tensors" in rows["hf"]["capabilities"]
    assert rows["example"]["distribution"] == "rollgen-example"
