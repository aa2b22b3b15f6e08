"""The package's import graph: data flows one way, so no module imports itself back through others.

Edges are what loading a module runs: the modules its imports name (at the top, inside functions, under
``if TYPE_CHECKING:``) and the packages above them whose ``__init__`` runs first. An import inside a function
is allowed only where :data:`LAZY_IMPORTS` says why, and never one that would close a circle at the top.
"""

from __future__ import annotations

import ast
import os

import abtrain

ROOT = os.path.dirname(abtrain.__file__)


def _module_name(path: str) -> str:
    rel = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
    return "abtrain" + ("" if rel == "__init__" else "." + rel.removesuffix(".__init__"))


def _package(path: str, module: str) -> str:
    return module if path.endswith("__init__.py") else module.rpartition(".")[0]


def _named(node: ast.Import | ast.ImportFrom, package: str) -> set[str]:
    """The abtrain modules one import statement names (``from . import checkpoint`` names the package and,
    where it is one, the module ``checkpoint``)."""
    if isinstance(node, ast.Import):
        return {a.name for a in node.names if a.name.startswith("abtrain")}
    base = package
    for _ in range(node.level - 1):
        base = base.rpartition(".")[0]
    target = (f"{base}.{node.module}" if node.module else base) if node.level else (node.module or "")
    if not target.startswith("abtrain"):
        return set()
    return {target} | {f"{target}.{a.name}" for a in node.names}


def _parse(path: str) -> ast.Module:
    with open(path) as fh:
        return ast.parse(fh.read())


def _imports(path: str, module: str) -> set[str]:
    """The abtrain modules ``module`` imports: at the top, inside functions, and under ``if TYPE_CHECKING:``
    (an annotation that names a module above is a circle in the design even when Python never runs it)."""
    package = _package(path, module)
    return {t for node in ast.walk(_parse(path)) if isinstance(node, (ast.Import, ast.ImportFrom))
            for t in _named(node, package)}


def function_imports(path: str, module: str) -> set[str]:
    """The abtrain modules ``module`` imports inside a function (run at the call, not when the module loads)."""
    package = _package(path, module)
    return {t for fn in ast.walk(_parse(path)) if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
            for node in ast.walk(fn) if isinstance(node, (ast.Import, ast.ImportFrom)) for t in _named(node, package)}


def top_imports(path: str, module: str) -> set[str]:
    """The abtrain modules ``module`` imports when it loads: every import outside a function."""
    package = _package(path, module)
    out: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                out.update(_named(child, package))
            elif not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                visit(child)

    visit(_parse(path))
    return out


def _modules() -> dict[str, str]:
    files = [os.path.join(d, f) for d, _, names in os.walk(ROOT) for f in names if f.endswith(".py")]
    return {_module_name(p): p for p in files}


def _loads(target: str, importer: str) -> set[str]:
    """What importing ``target`` from ``importer`` runs: ``target`` and every package above it whose
    ``__init__`` is not already running (the packages above ``importer``)."""
    parts = target.split(".")
    chain = {".".join(parts[:i]) for i in range(1, len(parts) + 1)}
    return {m for m in chain if not importer.startswith(m + ".")}


def _graph(imports) -> dict[str, set[str]]:
    modules = _modules()
    return {m: {t for n in imports(p, m) for t in _loads(n, m) if t in modules and t != m}
            for m, p in modules.items()}


def import_graph() -> dict[str, set[str]]:
    """Each module's edges: the modules its imports name and the packages above them whose ``__init__`` they run
    (``from ..methods.memory import x`` runs ``abtrain/methods/__init__.py`` first, with every import in it)."""
    return _graph(_imports)


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


def _path(graph: dict[str, set[str]], start: str, goal: str) -> list[str] | None:
    """One chain of imports from ``start`` to ``goal``, or None."""
    seen, stack = {start}, [(start, [start])]
    while stack:
        m, path = stack.pop()
        if m == goal:
            return path
        for t in sorted(graph.get(m, ())):
            if t not in seen:
                seen.add(t)
                stack.append((t, path + [t]))
    return None


#: The imports placed inside a function on purpose, by module, with why each cannot be at the top. None of them
#: may close a circle (test_no_function_level_import_hides_a_circle): a function-level import never works around one.
LAZY_IMPORTS: dict[str, tuple[set[str], str]] = {
    "abtrain.cli": ({"abtrain.sidebyside", "abtrain.sidebyside.workloads", "abtrain.config", "abtrain.data",
                     "abtrain.fetch", "abtrain.methods", "abtrain.methods.registry", "abtrain.models",
                     "abtrain.run.checkpoint", "abtrain.run.launch", "abtrain.run.rundir", "abtrain.run.safefile"},
                    "only the standard library at the top: main() installs the signal handlers before torch loads"),
    "abtrain.run.launch": ({"abtrain.run.plan", "abtrain.run.rundir", "abtrain.run.worker"},
                           "the launcher loads the workers' side (trainer, data, models) only when it starts them"),
}


def test_the_cycle_finder_finds_a_cycle():
    graph = {"abtrain.sidebyside.a": {"abtrain.sidebyside.b"}, "abtrain.sidebyside.b": {"abtrain.sidebyside.c"},
             "abtrain.sidebyside.c": {"abtrain.sidebyside.a"}, "abtrain.x": set()}
    assert find_cycle(graph) == ["abtrain.sidebyside.a", "abtrain.sidebyside.b", "abtrain.sidebyside.c", "abtrain.sidebyside.a"]
    assert find_cycle({"abtrain.x": {"abtrain.y"}, "abtrain.y": set()}) is None


def test_imports_under_type_checking_are_edges(tmp_path):
    path = tmp_path / "a.py"
    path.write_text("from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from .b import B\n")
    assert "abtrain.sidebyside.b" in _imports(str(path), "abtrain.sidebyside.a")


def test_importing_a_module_runs_the_packages_above_it():
    """``run.results`` importing ``methods.memory`` runs ``methods/__init__`` (and every method it registers);
    ``methods.base`` importing it runs nothing more (its own package is loading already)."""
    assert _loads("abtrain.methods.memory", "abtrain.run.results") == {"abtrain.methods", "abtrain.methods.memory"}
    assert _loads("abtrain.methods.memory", "abtrain.methods.base") == {"abtrain.methods.memory"}


def test_a_function_level_import_that_closes_a_circle_is_found(tmp_path):
    """``methods.base`` importing ``run.results`` inside a function, while ``run.results`` imports
    ``methods.memory`` at the top: at the top it would load ``methods/__init__`` and with it ``methods.base``."""
    path = tmp_path / "base.py"
    path.write_text("import os\n\n\ndef results():\n    from ..run.results import ddp_equivalent\n    return 1\n")
    assert function_imports(str(path), "abtrain.methods.base") == {"abtrain.run.results",
                                                                   "abtrain.run.results.ddp_equivalent"}
    top = {"abtrain.run.results": _loads("abtrain.methods.memory", "abtrain.run.results"),
           "abtrain.methods": {"abtrain.methods.base"}, "abtrain.methods.base": set(),
           "abtrain.methods.memory": set(), "abtrain": set()}
    assert _path(top, "abtrain.run.results", "abtrain.methods.base") == [
        "abtrain.run.results", "abtrain.methods", "abtrain.methods.base"]


def test_bench_has_no_import_circle():
    graph = import_graph()
    assert "abtrain.sidebyside.report" in graph and "abtrain.sidebyside.plots" in graph["abtrain.sidebyside.report"]
    assert find_cycle(graph, "abtrain.sidebyside") is None, find_cycle(graph, "abtrain.sidebyside")


def test_package_has_no_import_circle():
    cycle = find_cycle(import_graph())
    assert cycle is None, " -> ".join(cycle)


def test_function_level_imports_are_the_listed_ones():
    """An abtrain import inside a function is allowed only where :data:`LAZY_IMPORTS` says why."""
    modules = _modules()
    found = {m: {t for t in function_imports(p, m) if t in modules} for m, p in modules.items()}
    unlisted = {m: sorted(t - LAZY_IMPORTS.get(m, (set(), ""))[0]) for m, t in found.items()}
    unlisted = {m: t for m, t in unlisted.items() if t}
    assert not unlisted, f"imports inside functions without a reason in LAZY_IMPORTS (move them to the top): {unlisted}"
    stale = {m: sorted(listed - found.get(m, set())) for m, (listed, _) in LAZY_IMPORTS.items()}
    assert not any(stale.values()), f"LAZY_IMPORTS lists imports that are gone: {stale}"


def test_no_function_level_import_hides_a_circle():
    """Moved to the top, no function's import would close a circle: what it loads never loads the importer."""
    modules = _modules()
    top = _graph(top_imports)
    for m, p in modules.items():
        for name in function_imports(p, m):
            for t in sorted(_loads(name, m) & set(modules)):
                path = _path(top, t, m)
                assert path is None, f"{m} imports {name} inside a function; at the top: " + " -> ".join([m, *path])
