"""The core's imports go one way: no circle among its modules, and nothing in ``refit/`` or
``distributed/`` climbs back to the generation that uses it; the weight-sync group's modules
(``refit/transports/collective/``) import in layers. Read with ``ast`` (imports under
``TYPE_CHECKING`` count: a reader follows them too)."""

from __future__ import annotations

import ast
from pathlib import Path

import rollgen

ROOT = Path(rollgen.__file__).parent


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in ROOT.rglob("*.py")}


def resolve(dotted: str) -> str | None:
    """The core module a dotted name lives in (``rollgen.refit.WeightSpec``: ``rollgen.refit``)."""
    while dotted and dotted not in MODULES:
        dotted = dotted.rpartition(".")[0]
    return dotted or None


def imports_of(name: str) -> set[str]:
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            targets = [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        found |= {m for t in targets if (m := resolve(t)) and m != name}
    return found


GRAPH = {name: imports_of(name) for name in MODULES}


def circles() -> list[list[str]]:
    """The graph's strongly connected components of more than one module (Tarjan's)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while (w := stack.pop()) != v:
                component.append(w)
            if component:
                found.append(sorted([v, *component]))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    return found


def test_the_reader_sees_the_imports() -> None:
    """The graph is read right: known edges are in it (a guard for the tests below)."""
    assert "rollgen.refit.updates" in GRAPH["rollgen.base"]
    assert "rollgen.errors" in GRAPH["rollgen.refit.transports.collective.group"]


def test_the_core_has_no_import_circle() -> None:
    assert circles() == []


def test_refit_and_distributed_do_not_climb_to_the_generation() -> None:
    users = {"rollgen.base", "rollgen.distributed.generation"}
    faces = {"rollgen.refit", "rollgen.distributed"}  # the packages' faces export what they hold
    climbs = {
        name: sorted(GRAPH[name] & users)
        for name in GRAPH
        if name.startswith(("rollgen.refit", "rollgen.distributed"))
        and name not in users | faces
        and GRAPH[name] & users
    }
    assert climbs == {}


def test_the_replacement_policy_holds_neither_the_generation_nor_the_link() -> None:
    assert (
        GRAPH["rollgen.distributed.fleet"]
        & {
            "rollgen.distributed.generation",
            "rollgen.distributed.refit_link",
        }
        == set()
    )


def test_refit_link_imports_nothing_above_refit() -> None:
    above = {m for m in GRAPH["rollgen.refit.link"] if not m.startswith("rollgen.refit")}
    assert above <= {"rollgen.errors", "rollgen.spec", "rollgen.auth"}, above


COLLECTIVE = "rollgen.refit.transports.collective"
#: The weight-sync group's modules in the order they may import: each only those of earlier rows.
COLLECTIVE_LAYERS = [["spec"], ["wire"], ["group"], ["sender", "receiver"], ["transport"]]


def test_the_weight_sync_group_s_modules_import_one_way() -> None:
    row = {f"{COLLECTIVE}.{m}": i for i, names in enumerate(COLLECTIVE_LAYERS) for m in names}
    assert set(row) == {name for name in GRAPH if name.startswith(f"{COLLECTIVE}.")}  # each has a row
    against = {
        name: sorted(m for m in GRAPH[name] if m == COLLECTIVE or row.get(m, -1) >= row[name]) for name in row
    }
    assert {name: found for name, found in against.items() if found} == {}


def test_the_weight_sync_group_imports_nothing_above_refit() -> None:
    above = {m for name in GRAPH if name.startswith(COLLECTIVE) for m in GRAPH[name]}
    assert {m for m in above if not m.startswith("rollgen.refit")} <= {"rollgen.errors", "rollgen.auth"}
