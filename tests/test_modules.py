"""The package's layout: modules in groups whose imports run one way (a lower group never
imports a higher one, type-only imports included), no import cycle between modules at run
time, no module past a size a newcomer can read in one go, and every module listed in
docs/design.md's map."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "snaploader"
MAX_LINES = 600

# The groups from the bottom up (docs/design.md, "Modules"). A module may import its own
# group and the groups below it. The shared exceptions and options (the "_errors" group:
# _errors.py, _options.py) are below everything.
GROUP_ORDER = (
    "_errors",
    "_rng",
    "_state",
    "_format",
    "_workers",
    "_epoch",
    "_loader",
    "distributed",
    "shards",
    "mixture",
    "_tools",
    "integrations",
    "",  # the package's entry points: __init__, __main__, demo
)
# Top-level modules that belong to a group without a folder of their own.
TOP_LEVEL_GROUP = {"_errors": "_errors", "_options": "_errors", "_loader": "_loader", "_lifecycle": "_loader", "_view": "_loader", "_rebuild": "_loader"}


def _modules() -> dict[str, Path]:
    """Every module by its dotted name under the package (``_rng.raw``; ``""`` is the package)."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _group(module: str) -> str:
    head = module.split(".")[0]
    if "." in module or (PACKAGE / head).is_dir():
        return head
    return TOP_LEVEL_GROUP.get(head, "")


def _imports(module: str, path: Path, type_only: bool) -> set[str]:
    """The package modules ``module`` imports: at run time, or with ``type_only`` also
    those imported under ``TYPE_CHECKING``. Relative imports of any depth are resolved."""
    tree = ast.parse(path.read_text())
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    package = [p for p in package if p]
    found: set[str] = set()

    def target(node: ast.ImportFrom) -> list[str]:
        if node.level == 0:
            if not (node.module or "").startswith("snaploader"):
                return []
            base = (node.module or "").split(".")[1:]
        else:
            base = package[: len(package) - (node.level - 1)] + (node.module.split(".") if node.module else [])
        names = [".".join(base)]
        names += [".".join(base + [alias.name]) for alias in node.names]
        return [name for name in names if name in MODULES and name != module]

    def visit(node: ast.AST) -> None:
        if not type_only and isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return
        if isinstance(node, ast.ImportFrom):
            found.update(target(node))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("snaploader."):
                    name = alias.name.split(".", 1)[1]
                    if name in MODULES:
                        found.add(name)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    # The package itself ("") is only an import when named alone (``from . import x``
    # resolves to the submodule ``x``, added above).
    found.discard("")
    return found


def test_every_module_has_a_group() -> None:
    unknown = {m for m in MODULES if _group(m) not in GROUP_ORDER}
    assert not unknown, f"modules outside the groups of docs/design.md: {sorted(unknown)}"


def test_imports_run_one_way_between_groups() -> None:
    rank = {group: i for i, group in enumerate(GROUP_ORDER)}
    upward = []
    for module, path in MODULES.items():
        for imported in _imports(module, path, type_only=True):
            if rank[_group(imported)] > rank[_group(module)]:
                upward.append(f"{module} ({_group(module) or 'top'}) imports {imported} ({_group(imported)})")
    assert not upward, "imports against the group order:\n" + "\n".join(sorted(upward))


def test_the_group_rule_sees_relative_imports_of_any_depth() -> None:
    # The check above must not pass for want of resolving ``..`` imports.
    assert "_state.records" in _imports("_workers.messages", MODULES["_workers.messages"], True)
    assert "_format.parse" in _imports("distributed.rules", MODULES["distributed.rules"], True)


@pytest.mark.parametrize("type_only", [False, True], ids=["run time", "type-only imports included"])
def test_no_import_cycle(type_only: bool) -> None:
    # Not even a circle closed only under TYPE_CHECKING: two modules that need each other
    # are one concern.
    graph = {module: _imports(module, path, type_only=type_only) for module, path in MODULES.items()}
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
    long = {str(p.relative_to(PACKAGE)): n for p in MODULES.values() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}; split them by concern"


def test_every_module_is_in_the_design_map() -> None:
    design = (ROOT / "docs" / "design.md").read_text()
    section = design.split("## Modules", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1] for line in section.splitlines() if line.startswith("| `")]
    listed = {name for row in rows for name in re.findall(r"`([\w/]+\.py)`", row)}
    files = {str(p.relative_to(PACKAGE)) for p in MODULES.values() if p.name != "__init__.py"}
    missing = sorted(files - listed)
    stale = sorted(f for f in listed if not (PACKAGE / f).exists())
    assert not missing, f"modules missing from docs/design.md's map: {missing}"
    assert not stale, f"docs/design.md's map names modules that do not exist: {stale}"


def test_every_module_says_what_it_holds() -> None:
    bare = [str(p.relative_to(PACKAGE)) for p in MODULES.values()
            if p.read_text().strip() and ast.get_docstring(ast.parse(p.read_text())) is None]
    assert not bare, f"modules without a docstring: {bare}"
