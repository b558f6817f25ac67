"""The test suite imports nothing from benchmarks/ (issue 35, item 5): the benchmarks are commands, free to change
shape; what a test and a benchmark both need lives in hybridserve/ (or in tests/, for the tests' own helpers), and
a test of a benchmark runs it as a command (`python -m benchmarks.ENTRY`)."""
from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def benchmark_imports(source: str) -> set[str]:
    """The benchmarks modules `source` imports (import statements anywhere, importlib.import_module of a literal)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found |= {node.module} if node.module != "benchmarks" else {f"benchmarks.{a.name}" for a in node.names}
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr == "import_module" and node.args and isinstance(node.args[0], ast.Constant):
            found.add(str(node.args[0].value))
    return {name for name in found if name == "benchmarks" or name.startswith("benchmarks.")}


def test_benchmark_imports_are_recognised():
    assert benchmark_imports("import benchmarks.ops\nfrom benchmarks import serving\n"
                             "def f():\n    from benchmarks.offline.scenarios import workload\n"
                             "importlib.import_module('benchmarks.cli')\nimport hybridserve, benchmarks_extra\n"
                             "from . import benchmarks\n") == \
        {"benchmarks.ops", "benchmarks.serving", "benchmarks.offline.scenarios", "benchmarks.cli"}


def test_no_test_imports_from_benchmarks():
    found = {}
    for path in sorted(TESTS.rglob("*.py")):
        names = benchmark_imports(path.read_text())
        if names:
            found[str(path.relative_to(TESTS.parent))] = names
    assert not found, found
