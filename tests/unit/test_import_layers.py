"""Imports point one way (issue 35, item 2): every module of `hybridserve` sits at one level of `LEVELS`, imports
only modules of its own level or of lower ones, and no modules import each other in a cycle.

Every import statement counts wherever it stands: at the top, inside a function (a lazy import), under
TYPE_CHECKING. `from p import name` names the module `p.name` when there is one, else `p`; relative imports are
resolved against the importing module's package. A package's `__init__` is a module like any other: importing
`p.q` is an edge to `p.q` alone (Python runs `p/__init__.py` first, but what `p.q` needs is `p.q`).

`LEVELS` is the one statement of the layering (docs/architecture.md describes it): a top-level package or module of
hybridserve that it does not place fails the test until it is given a level.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

PACKAGE = "hybridserve"
ROOT = Path(__file__).resolve().parents[2] / PACKAGE

# Top to bottom: hybridserve's top-level packages and modules ("__init__" is hybridserve/__init__.py) by level.
LEVELS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("entry points", ("__init__", "__main__", "cli", "llm", "demo", "hub")),
    ("server", ("server",)),
    ("parsers", ("parsers",)),  # tool-call and reasoning formats: the server's alone
    ("engine", ("engine",)),
    ("runtime", ("runtime",)),
    ("spec", ("spec",)),  # n-gram search, acceptance + state commit, the MTP drafter: engine's and runtime's
    ("models", ("models",)),
    ("cache", ("cache",)),  # pools, prefix tree, memory planner: what the models' cache layouts describe
    # EngineConfig and its CLI fields; checkpoint reading; the generation config's end ids and sampling defaults
    ("config", ("config", "options", "checkpoint", "generation_config")),
    ("layers", ("layers",)),
    ("ops", ("ops",)),
    ("requests", ("sampling", "outputs", "structured", "tokenizer")),  # what a request asks for and gets back
    ("core", ("core",)),
)


@dataclass(frozen=True)
class Edge:
    importer: str
    imported: str
    line: int


def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_sources(root: Path = ROOT) -> dict[str, tuple[str, bool]]:
    """{module name: (its source, whether it is a package's __init__)} for every module under `root`."""
    return {module_name(path, root): (path.read_text(), path.name == "__init__.py") for path in root.rglob("*.py")}


def import_edges(sources: dict[str, tuple[str, bool]]) -> list[Edge]:
    """Every import of one of `sources`' modules by another, each resolved to the module it names."""
    def known(name: str) -> str | None:  # the longest prefix of `name` that is a module
        while name and name not in sources:
            name = name.rpartition(".")[0]
        return name or None

    edges = []
    for importer, (source, is_package) in sources.items():
        package = importer if is_package else importer.rpartition(".")[0]
        for node in ast.walk(ast.parse(source)):
            targets: list[str | None] = []
            if isinstance(node, ast.Import):
                targets = [known(alias.name) for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # `from ..x import y` in package a.b.c: a.b.x
                    parts = package.split(".")
                    base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in sources else known(base)
                           for alias in node.names]
            edges += [Edge(importer, target, node.lineno) for target in dict.fromkeys(targets)
                      if target is not None and target != importer]
    return edges


def level_of(module: str) -> int | None:
    """The index in LEVELS (0 = top) of `module`'s top-level package or module; None if it has none."""
    top = module.split(".")[1] if "." in module else "__init__"
    return next((i for i, (_, names) in enumerate(LEVELS) if top in names), None)


def unplaced(modules) -> list[str]:
    return sorted(module for module in modules if level_of(module) is None)


def upward(edges: list[Edge]) -> list[str]:
    """The imports of a module by one of a lower level, described."""
    found = []
    for edge in edges:
        low, high = level_of(edge.importer), level_of(edge.imported)
        if low is not None and high is not None and high < low:
            found.append(f"{edge.importer} ({LEVELS[low][0]}) imports {edge.imported} ({LEVELS[high][0]}), "
                         f"line {edge.line}")
    return found


def cycles(edges: list[Edge]) -> list[list[str]]:
    """One cycle [a, b, ..., a] through each strongly connected set of modules (Tarjan's algorithm)."""
    graph: dict[str, list[str]] = {}
    for edge in edges:
        graph.setdefault(edge.importer, []).append(edge.imported)
        graph.setdefault(edge.imported, [])
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    components: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for succ in graph[node]:
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = set()
            while node not in component:
                component.add(stack.pop())
            if len(component) > 1:
                components.append(component)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return [_cycle_within(graph, component) for component in components]


def _cycle_within(graph: dict[str, list[str]], component: set[str]) -> list[str]:
    """A shortest cycle through the component's first module (breadth-first, inside the component)."""
    start = min(component)
    parents = {start: start}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for succ in graph[node]:
                if succ == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(parents[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if succ in component and succ not in parents:
                    parents[succ] = node
                    following.append(succ)
        frontier = following
    raise AssertionError(f"no cycle through {start}")  # a strongly connected set always has one


def test_every_top_level_module_has_a_level() -> None:
    missing = unplaced(package_sources())
    assert not missing, f"give these a level in LEVELS: {missing}"


def test_imports_point_down() -> None:
    found = upward(import_edges(package_sources()))
    assert not found, "imports from a lower level to a higher one:\n" + "\n".join(found)


def test_no_import_cycles() -> None:
    found = cycles(import_edges(package_sources()))
    assert not found, "import cycles:\n" + "\n".join(" -> ".join(cycle) for cycle in found)


def test_the_checker_reports_what_it_should() -> None:
    """A synthetic package: core.a imports engine.b lazily (upward), which imports core.a back (a cycle), by a
    relative `from .. import` form; ops.c imports ops.d as `import a.b`, and `from . import` names a module."""
    sources = {
        "hybridserve": ("", True),
        "hybridserve.core": ("", True),
        "hybridserve.core.a": ("def f():\n    from hybridserve.engine.b import run\n", False),
        "hybridserve.engine": ("", True),
        "hybridserve.engine.b": ("from ..core import a\n\ndef run():\n    pass\n", False),
        "hybridserve.ops": ("from . import d\n", True),
        "hybridserve.ops.c": ("import hybridserve.ops.d\n", False),
        "hybridserve.ops.d": ("", False),
        "hybridserve.nowhere": ("", False),
    }
    edges = import_edges(sources)
    assert {(e.importer, e.imported) for e in edges} == {
        ("hybridserve.core.a", "hybridserve.engine.b"), ("hybridserve.engine.b", "hybridserve.core.a"),
        ("hybridserve.ops", "hybridserve.ops.d"), ("hybridserve.ops.c", "hybridserve.ops.d")}
    assert upward(edges) == ["hybridserve.core.a (core) imports hybridserve.engine.b (engine), line 2"]
    assert cycles(edges) == [["hybridserve.core.a", "hybridserve.engine.b", "hybridserve.core.a"]]
    assert unplaced(sources) == ["hybridserve.nowhere"]
