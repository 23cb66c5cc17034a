"""The package's module graph: no import cycles, type-only imports included (a
`TYPE_CHECKING` import of a module that imports you is still a circle a reader must
untangle)."""

from __future__ import annotations

import ast
from pathlib import Path

DRIVER = Path(__file__).resolve().parents[2] / "driver"


def _module_name(path: Path) -> str:
    parts = path.relative_to(DRIVER.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The driver modules `path` imports (`from pkg import mod` counts as `pkg.mod`)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in modules)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"
                found.add(submodule if submodule in modules else node.module)
    return {name for name in found if name in modules}


def _graph() -> dict[str, set[str]]:
    paths = {_module_name(p): p for p in DRIVER.rglob("*.py")}
    modules = set(paths)
    # A package's __init__ re-exports are not edges between its modules.
    return {
        name: _imports(path, modules) - {name}
        for name, path in paths.items()
        if path.name != "__init__.py"
    }


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    cycles: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                cycles.append([*path[path.index(target) :], target])
            elif target not in state:
                visit(target)
        path.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return cycles


def test_cycle_finder_finds_a_circle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_driver_modules_import_no_circle() -> None:
    graph = _graph()
    assert "driver.state.plan" in graph  # the walk found the package
    assert _cycles(graph) == []
