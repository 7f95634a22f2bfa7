"""The package's layout: imports run one way (no cycle between its modules, type-only
imports aside), and no module grows past a size a newcomer can read in one go."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "snaploader"
MAX_LINES = 420


def _imports(path: Path) -> set[str]:
    """The package modules ``path`` imports at run time (not under TYPE_CHECKING)."""
    tree = ast.parse(path.read_text())
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module:
                found.add(node.module)
            else:
                found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("snaploader."):
            found.add(node.module.split(".", 1)[1])  # type: ignore[union-attr]
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return {name for name in found if (PACKAGE / f"{name}.py").exists()}


def test_no_import_cycle() -> None:
    graph = {path.stem: _imports(path) for path in PACKAGE.glob("*.py")}
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def walk(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(graph.get(module, ())):
            if state.get(target) == 1:
                cycle = path[path.index(target):] + [target]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if target not in state:
                walk(target, path + [target])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            walk(module, [module])


def test_no_module_is_too_long() -> None:
    long = {p.name: n for p in PACKAGE.glob("*.py") if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}; split them by concern"
