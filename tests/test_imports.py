"""The package's import graph has no cycles.

Module-level imports count, those for type checking too (they say what a module depends on);
imports inside functions are deferred on purpose and do not.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def top_level_imports(tree: ast.Module) -> list[str]:
    """Names imported by the module body (not inside functions or classes)."""
    names: list[str] = []
    pending: list[ast.stmt] = list(tree.body)
    while pending:
        node = pending.pop()
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names += [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.If):
            pending += node.body + node.orelse
        elif isinstance(node, ast.Try):
            pending += node.body + node.orelse + node.finalbody
            for handler in node.handlers:
                pending += handler.body
    return names


def import_graph() -> dict[str, set[str]]:
    paths = {module_name(p): p for p in (ROOT / "draftflow").rglob("*.py")}
    return {
        name: {
            dep
            for dep in top_level_imports(ast.parse(path.read_text()))
            if dep in paths and dep != name
        }
        for name, path in paths.items()
    }


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle (a list of modules, first = last), or None."""
    done: set[str] = set()

    def walk(node: str, trail: list[str]) -> list[str] | None:
        if node in trail:
            return [*trail[trail.index(node) :], node]
        if node in done:
            return None
        for dep in sorted(graph[node]):
            if cycle := walk(dep, [*trail, node]):
                return cycle
        done.add(node)
        return None

    for start in sorted(graph):
        if cycle := walk(start, []):
            return cycle
    return None


def test_no_import_cycles():
    assert find_cycle(import_graph()) is None


def test_find_cycle_sees_one():
    assert find_cycle({"a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]
