"""The package's import graph: data flows one way, so no module imports itself back through others."""

from __future__ import annotations

import ast
import os

import abtrain

ROOT = os.path.dirname(abtrain.__file__)


def _module_name(path: str) -> str:
    rel = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
    return "abtrain" + ("" if rel == "__init__" else "." + rel.removesuffix(".__init__"))


def _imports(path: str, module: str) -> set[str]:
    """The abtrain modules ``module`` imports: at the top, inside functions, and under ``if TYPE_CHECKING:``
    (an annotation that names a module above is a circle in the design even when Python never runs it)."""
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    out: set[str] = set()
    with open(path) as fh:
        tree = ast.parse(fh.read())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("abtrain"))
        elif isinstance(node, ast.ImportFrom):
            base = package
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            target = (f"{base}.{node.module}" if node.module else base) if node.level else (node.module or "")
            if target.startswith("abtrain"):
                out.add(target)
                out.update(f"{target}.{a.name}" for a in node.names)  # ``from . import checkpoint``
    return out


def import_graph() -> dict[str, set[str]]:
    files = [os.path.join(d, f) for d, _, names in os.walk(ROOT) for f in names if f.endswith(".py")]
    modules = {_module_name(p): p for p in files}
    return {m: {t for t in _imports(p, m) if t in modules and t != m} for m, p in modules.items()}


def find_cycle(graph: dict[str, set[str]], within: str = "abtrain") -> list[str] | None:
    """One import circle among the modules under ``within`` (a package prefix), or None.

    An edge from a module to a package above it (``from .. import lowrank`` names ``abtrain``) is
    left out: that package's ``__init__`` importing its modules back is how packages load, not a circle.
    """
    nodes = {m for m in graph if m.startswith(within)}
    edges = {m: {t for t in graph[m] if t in nodes and not m.startswith(t + ".")} for m in nodes}
    state: dict[str, int] = {}
    stack: list[str] = []

    def dfs(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for t in sorted(edges[m]):
            if state.get(t) == 1:
                return stack[stack.index(t):] + [t]
            if t not in state:
                found = dfs(t)
                if found:
                    return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(nodes):
        if m not in state:
            found = dfs(m)
            if found:
                return found
    return None


def test_the_cycle_finder_finds_a_cycle():
    graph = {"abtrain.bench.a": {"abtrain.bench.b"}, "abtrain.bench.b": {"abtrain.bench.c"},
             "abtrain.bench.c": {"abtrain.bench.a"}, "abtrain.x": set()}
    assert find_cycle(graph) == ["abtrain.bench.a", "abtrain.bench.b", "abtrain.bench.c", "abtrain.bench.a"]
    assert find_cycle({"abtrain.x": {"abtrain.y"}, "abtrain.y": set()}) is None


def test_imports_under_type_checking_are_edges(tmp_path):
    path = tmp_path / "a.py"
    path.write_text("from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from .b import B\n")
    assert "abtrain.bench.b" in _imports(str(path), "abtrain.bench.a")


def test_bench_has_no_import_circle():
    graph = import_graph()
    assert "abtrain.bench.report" in graph and "abtrain.bench.plots" in graph["abtrain.bench.report"]
    assert find_cycle(graph, "abtrain.bench") is None, find_cycle(graph, "abtrain.bench")


def test_package_has_no_import_circle():
    cycle = find_cycle(import_graph())
    assert cycle is None, " -> ".join(cycle)
