"""benchmarks/ by purpose (benchmarks/README.md): the parts import one another in one direction
only, and no module of it takes part in an import cycle (imports inside functions count; those
under `if TYPE_CHECKING:` do not)."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
PARTS = ("testbed", "harness")  # the rest: the benchmarks the docs cite ("top")
# what each part may import (besides itself)
ALLOWED = {
    "testbed": {"testbed"},
    "harness": {"testbed", "harness"},
    "top": {"testbed", "harness", "top"},
}


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in sorted((ROOT / "benchmarks").rglob("*.py")):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = path
    return out


def _imports(path: pathlib.Path, known: dict[str, pathlib.Path]) -> set[str]:
    tree = ast.parse(path.read_text())
    typing_only = {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for stmt in node.body
        for inner in ast.walk(stmt)
    }
    found = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in known else node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {name for name in found if name in known}


def _part(module: str) -> str:
    bits = module.split(".")
    return bits[1] if len(bits) > 1 and bits[1] in PARTS else "top"


def _graph() -> dict[str, set[str]]:
    known = _modules()
    return {name: _imports(path, known) - {name} for name, path in known.items()}


def test_the_parts_import_one_another_in_one_direction():
    wrong = [
        f"{module} ({_part(module)}) imports {dep} ({_part(dep)})"
        for module, deps in _graph().items()
        for dep in sorted(deps)
        if _part(dep) not in ALLOWED[_part(module)]
    ]
    assert not wrong, "\n".join(wrong)


def test_no_module_takes_part_in_an_import_cycle():
    graph = _graph()
    cycles = []
    for start in graph:  # a module that reaches itself
        seen, stack = set(), [(dep, [start, dep]) for dep in graph[start]]
        while stack:
            module, path = stack.pop()
            if module == start:
                cycles.append(" -> ".join(path))
                break
            if module in seen:
                continue
            seen.add(module)
            stack.extend((dep, [*path, dep]) for dep in graph[module])
    assert not cycles, "\n".join(cycles)


def test_the_graph_is_read():
    # the checks above read real imports: the rank program's and the harness's are there
    graph = _graph()
    assert "benchmarks.testbed.models" in graph["benchmarks.testbed.train_worker"]
    assert "benchmarks.harness.policy" in graph["benchmarks.harness.policies"]
    assert "benchmarks.testbed.wire" in graph["benchmarks.bench_emulated"]
