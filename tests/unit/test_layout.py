"""The package's import layering, read from the source with `ast` (no module is imported, except in the last test).

Rules (docs/architecture.md, "Layout"):
- no import cycle among astratk modules at module level (function-level and `if TYPE_CHECKING:` imports excluded:
  they run after every module has loaded, or never);
- `astratk.training` never imports `astratk.runtime`, and `astratk.engines` never imports `astratk.training`: a
  trainer knows nothing about Dask deployments, an engine nothing about Lightning (any level, lazy ones included);
- the core (astratk minus astratk.envs and astratk.losses) never imports a concrete env (any level; dotted paths
  in strings, as the registry holds, are not imports);
- `import astratk.spec` loads no torch: the configuration schema is a leaf that the CLI, notebooks and cluster jobs
  read cheaply.

Every failure names the importing module, its file and line, and the import statement.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Source folder -> the package it installs as (pyproject's package-dir).
PACKAGES = {"astratk": ROOT / "astratk", "astratk.envs": ROOT / "envs", "astratk.losses": ROOT / "losses"}
PLUGINS = ("astratk.envs", "astratk.losses")


@dataclass(frozen=True)
class Import:
    """One import statement's edge: `source` imports `target` (a module of the tree) at `path:line`."""

    source: str
    target: str
    path: Path
    line: int
    statement: str
    lazy: bool  # inside a function (runs when called)
    type_checking: bool  # under `if TYPE_CHECKING:` (never runs)

    def __str__(self) -> str:
        where = " (function-level)" if self.lazy else " (TYPE_CHECKING)" if self.type_checking else ""
        return f"{self.source} ({self.path.relative_to(ROOT)}:{self.line}){where}: {self.statement}"


def module_files() -> dict[str, Path]:
    """Every module of the tree by dotted name; a package is its `__init__.py`."""
    modules: dict[str, Path] = {}
    for package, folder in PACKAGES.items():
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join((package, *parts))] = path
    return modules


MODULES = module_files()


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _statements(tree: ast.Module) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool, bool]]:
    """(import node, lazy, type_checking) for every import in the module, at any depth."""

    def walk(node: ast.AST, lazy: bool, type_checking: bool) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool, bool]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child, lazy, type_checking
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                yield from walk(child, True, type_checking)
            elif isinstance(child, ast.If) and _is_type_checking(child.test):
                for stmt in child.body:
                    yield from walk(ast.Module(body=[stmt], type_ignores=[]), lazy, True)
                for stmt in child.orelse:
                    yield from walk(ast.Module(body=[stmt], type_ignores=[]), lazy, type_checking)
            else:
                yield from walk(child, lazy, type_checking)

    yield from walk(tree, False, False)


def _targets(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> list[str]:
    """The tree modules an import statement loads (outside the tree: none), relative imports resolved. `from X
    import Y` loads X.Y when that is a module, else X."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        if node.level:
            parts = module.split(".") if is_package else module.split(".")[:-1]
            parts = parts[: len(parts) - (node.level - 1)]
            base = ".".join(parts + ([node.module] if node.module else []))
        else:
            base = node.module or ""
        names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]
    return [name for name in dict.fromkeys(names) if name in MODULES]


def _ancestors(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def collect_imports() -> list[Import]:
    """Every import edge of the tree. Importing a module first runs its packages' `__init__`s, so an edge to
    `a.b.c` also stands for edges to `a.b` and `a` (except the importer's own packages, already loading)."""
    edges: list[Import] = []
    for module, path in MODULES.items():
        source = path.read_text()
        lines = source.splitlines()
        is_package = path.name == "__init__.py"
        own = set(_ancestors(module)) | {module}
        for node, lazy, type_checking in _statements(ast.parse(source, str(path))):
            statement = " ".join(line.strip() for line in lines[node.lineno - 1: node.end_lineno])
            for target in _targets(node, module, is_package):
                implied = [p for p in _ancestors(target) if p not in own]
                for t in [*implied, target]:
                    edges.append(Import(module, t, path, node.lineno, statement, lazy, type_checking))
    return edges


IMPORTS = collect_imports()


def within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def test_the_parser_sees_every_kind_of_import():
    """A check on the checker: relative, `from`, plain, function-level and TYPE_CHECKING imports are all edges."""
    spec = {(e.target, e.lazy, e.type_checking) for e in IMPORTS if e.source == "astratk.spec"}
    assert ("astratk.contracts", False, False) in spec
    assert ("astratk.dataflow.stages.base", False, False) in spec
    assert ("astratk.dataflow", False, False) in spec  # the package whose __init__ runs first
    config = {e.target for e in IMPORTS if e.source == "astratk.config"}
    assert "astratk.spec" in config
    assert any(e.type_checking for e in IMPORTS), "no `if TYPE_CHECKING:` import found: the parser misses them"
    assert any(e.lazy for e in IMPORTS), "no function-level import found: the parser misses them"
    losses = {e.target for e in IMPORTS if within(e.source, "astratk.losses")}
    assert "astratk.contracts" in losses  # losses/ parsed as astratk.losses


def _cycles(edges: list[Import]) -> list[list[Import]]:
    """One cycle (as its edges) per strongly connected component with more than one module (or a self-import)."""
    graph: dict[str, dict[str, Import]] = {}
    for e in edges:
        graph.setdefault(e.source, {}).setdefault(e.target, e)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def connect(v: str) -> None:  # Tarjan; the tree has ~150 modules, recursion depth is no concern
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            components.append(component)

    for v in sorted(graph):
        if v not in index:
            connect(v)
    cycles = []
    for component in components:
        members = set(component)
        start = min(component)
        if len(component) == 1 and start not in graph.get(start, {}):
            continue
        # The shortest path from start back to itself inside the component (breadth-first).
        parents: dict[str, Import] = {}
        frontier = [start]
        found: Import | None = None
        while frontier and found is None:
            nxt = []
            for v in frontier:
                for w, e in sorted(graph.get(v, {}).items()):
                    if w == start:
                        found = e
                        break
                    if w in members and w not in parents:
                        parents[w] = e
                        nxt.append(w)
                if found:
                    break
            frontier = nxt
        assert found is not None
        path = [found]
        while path[-1].source != start:
            path.append(parents[path[-1].source])
        cycles.append(path[::-1])
    return cycles


def test_the_cycle_finder_reports_each_edge_of_a_cycle():
    """A check on the checker: a -> b -> c -> a is found (as its three edges, in order), a -> d is not in it."""
    def edge(source, target, line):
        return Import(source, target, ROOT / "x.py", line, f"import {target}", False, False)

    found = _cycles([edge("a", "b", 1), edge("b", "c", 2), edge("c", "a", 3), edge("a", "d", 4), edge("d", "d2", 5)])
    assert [[(e.source, e.target, e.line) for e in c] for c in found] == [[("a", "b", 1), ("b", "c", 2), ("c", "a", 3)]]
    assert _cycles([edge("a", "b", 1), edge("b", "c", 2)]) == []


def test_no_module_level_import_cycle():
    edges = [e for e in IMPORTS if not e.lazy and not e.type_checking]
    cycles = _cycles(edges)
    report = "\n\n".join(" -> ".join([c[0].source, *(e.target for e in c)]) + "\n" +
                         "\n".join(f"  {e}" for e in c) for c in cycles)
    assert not cycles, ("module-level import cycles (make one import lazy, move it under TYPE_CHECKING when it is only "
                        f"an annotation, or move the shared code down a layer):\n{report}")


def _forbidden(importers: str, imported: str, exclude: tuple[str, ...] = ()) -> list[Import]:
    return [e for e in IMPORTS if within(e.source, importers) and within(e.target, imported)
            and not any(within(e.source, x) for x in exclude)]


def _layer_report(edges: list[Import]) -> str:
    # Implied package edges repeat a statement; show each statement once.
    seen = dict.fromkeys((e.source, e.path, e.line, e.statement, e.lazy, e.type_checking) for e in edges)
    return "\n".join(str(Import(s, "", p, n, st, lz, tc)) for s, p, n, st, lz, tc in seen)


# (importer, imported) -> why not, and where the shared code goes instead
LAYERS = {
    ("astratk.training", "astratk.runtime"): "a trainer knows nothing about deployments; move the shared code to "
                                             "astratk.runtime (the caller) or a lower layer (astratk.models)",
    ("astratk.engines", "astratk.training"): "an engine knows nothing about the trainer; move the shared code to "
                                             "astratk.models",
    ("astratk.rollout", "astratk.runtime"): "rollout services are started by the runtime, not the other way round; "
                                            "move the shared code to astratk.rollout",
    ("astratk.dataflow", "astratk.runtime"): "the data layer is deployed by the runtime; it knows nothing about it",
    ("astratk.dataflow", "astratk.training"): "the data layer serves records; the trainer collates them",
}


@pytest.mark.parametrize(("importers", "imported"), list(LAYERS))
def test_layers(importers, imported):
    bad = _forbidden(importers, imported)
    why = LAYERS[importers, imported]
    assert not bad, f"{importers} imports {imported} ({why}):\n{_layer_report(bad)}"


def test_the_core_imports_no_concrete_env():
    bad = _forbidden("astratk", "astratk.envs", exclude=PLUGINS)
    assert not bad, ("the core imports astratk.envs (core code never imports a concrete env; name it by "
                     f"dotted path or registry short name, or move the shared helper into the core):\n{_layer_report(bad)}")


# Finds who first imports torch: a meta-path finder that records the import stack and finds nothing itself.
_PROBE = textwrap.dedent("""
    import sys, traceback

    class Spy:
        stack = None

        def find_spec(self, name, path=None, target=None):
            if name == "torch" and Spy.stack is None and importing("torch"):
                Spy.stack = [f"  {f.filename}:{f.lineno}: {f.line}" for f in traceback.extract_stack()[:-2]
                             if not f.filename.startswith("<")]
            return None

    # Whether the innermost import in progress is `name` (importlib.util.find_spec, which astratk._addons calls,
    # only locates the files: an outer import is then the innermost one).
    def importing(name):
        frame = sys._getframe(1)
        while frame is not None:
            if frame.f_code.co_name == "_find_and_load":
                return frame.f_locals.get("name") == name
            frame = frame.f_back
        return False

    sys.meta_path.insert(0, Spy())
    import {module}
    if "torch" in sys.modules:
        print("\\n".join(Spy.stack or ["  (torch was imported before the probe)"]))
        sys.exit(1)
""")


@pytest.mark.parametrize("module", ["astratk", "astratk.spec", "astratk.models.chat", "astratk.dataflow.leases"])
def test_importing_loads_no_torch(module):
    """A fresh interpreter: `import astratk.spec` (and the package) must not load torch; neither must the chat
    encoding envs import (an env built for a spec's default would pay torch and transformers' import time, ~5 s) nor
    the data layer's lease book."""
    out = subprocess.run([sys.executable, "-c", _PROBE.replace("{module}", module)], capture_output=True, text=True,
                         timeout=120, cwd=ROOT, check=False)
    assert out.returncode == 0, f"`import {module}` loads torch, first through:\n{out.stdout}{out.stderr}"
