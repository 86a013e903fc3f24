"""The package stack: config <- model <- plan, precision, parallel <- train <- exports, report
<- jobs <- cli.

Every import between factory's packages (``TYPE_CHECKING`` imports included) points down the
stack or across one level, and no group of packages imports itself in a loop. The stack is
drawn in ``docs/architecture.md``; a new package or top-level module is placed in it here.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

STACK: list[tuple[str, set[str]]] = [
    (
        "config",
        {
            "schemas",
            "kernels",
            "blueprints",
            "data_recipes",
            "loading",
            "errors",
            "diagnostic_formats",
            "dotted_paths",
            "deep_merge",
            "folder_lock",
            "io",
            "lazy",
            "json_schema",
            "progress",
            "rank_process",
        },
    ),
    ("model", {"spec", "nn", "layers", "graph", "data"}),
    (
        "plan, precision, parallel",
        {
            "planner",
            "precision",
            "checks",
            "distributed",
            "proxy",
            "proxy_layout",
            "layout_search",
            "compilation",
        },
    ),
    ("train", {"runtime", "generation"}),
    ("exports, report", {"exports", "report"}),
    ("jobs", {"jobs"}),
    ("cli", {"cli", "__main__", "__init__"}),
]
LEVEL = {unit: level for level, (_, units) in enumerate(STACK) for unit in units}
SOURCES = {"factory": ROOT / "factory", "schemas": ROOT / "schemas", "kernels": ROOT / "kernels"}


def _unit_of_file(path: Path) -> str:
    """The stack unit a source file belongs to: its first-level package or top-level module."""
    for unit, folder in SOURCES.items():
        if unit != "factory" and path.is_relative_to(folder):
            return unit
    relative = path.relative_to(SOURCES["factory"])
    return relative.parts[0] if len(relative.parts) > 1 else relative.stem


def _unit_of_module(module: str) -> str | None:
    """The stack unit of an imported ``factory...`` module (None outside factory)."""
    parts = module.split(".")
    if parts[0] != "factory":
        return None
    return parts[1] if len(parts) > 1 else "__init__"


def _imported_modules(tree: ast.Module, path: Path) -> list[tuple[int, str]]:
    """Every module an ``import`` statement anywhere in ``tree`` names, with its line."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the file's package
                package = _package_of(path).split(".")
                base = package[: len(package) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if module != "factory":
                found.append((node.lineno, module))
                continue
            # `from factory import data` names the subpackage; `from factory import train`
            # the public API of factory/__init__.py, which sits at the top of the stack.
            for alias in node.names:
                is_module = _is_factory_module(alias.name)
                found.append((node.lineno, f"factory.{alias.name}" if is_module else module))
    return found


def _is_factory_module(name: str) -> bool:
    folder = SOURCES.get(name, SOURCES["factory"] / name)
    return folder.is_dir() or (SOURCES["factory"] / f"{name}.py").is_file()


def _package_of(path: Path) -> str:
    for unit, folder in SOURCES.items():
        if path.is_relative_to(folder):
            inner = path.relative_to(folder).with_suffix("").parts
            prefix = ["factory"] if unit == "factory" else ["factory", unit]
            return ".".join(prefix + list(inner[:-1]))
    raise AssertionError(path)


def _edges() -> dict[tuple[str, str], list[str]]:
    """(importing unit, imported unit) -> the ``file:line`` of each such import."""
    edges: dict[tuple[str, str], list[str]] = {}
    for folder in SOURCES.values():
        for path in sorted(folder.rglob("*.py")):
            source = _unit_of_file(path)
            for line, module in _imported_modules(ast.parse(path.read_text()), path):
                target = _unit_of_module(module)
                if target is None or target == source:
                    continue
                where = f"{path.relative_to(ROOT)}:{line}"
                edges.setdefault((source, target), []).append(where)
    return edges


EDGES = _edges()


def test_every_unit_has_a_place_in_the_stack() -> None:
    units = {unit for pair in EDGES for unit in pair}
    units |= {_unit_of_file(p) for folder in SOURCES.values() for p in folder.rglob("*.py")}
    assert sorted(units - set(LEVEL)) == []


def test_imports_never_point_up_the_stack() -> None:
    upward = [
        f"{where}: {source} ({STACK[LEVEL[source]][0]}) imports {target} "
        f"({STACK[LEVEL[target]][0]})"
        for (source, target), places in sorted(EDGES.items())
        if source in LEVEL and target in LEVEL and LEVEL[target] > LEVEL[source]
        for where in places
    ]
    assert upward == []


def test_no_units_import_each_other_in_a_loop() -> None:
    graph: dict[str, set[str]] = {}
    for source, target in EDGES:
        graph.setdefault(source, set()).add(target)
    state: dict[str, int] = {}  # 1 on the path being walked, 2 done

    def visit(unit: str, path: list[str]) -> list[str] | None:
        state[unit] = 1
        for target in sorted(graph.get(unit, ())):
            if state.get(target) == 1:
                return [*path[path.index(target) :], target] if target in path else [unit, target]
            if target not in state and (cycle := visit(target, [*path, target])):
                return cycle
        state[unit] = 2
        return None

    for unit in sorted(graph):
        if unit not in state and (cycle := visit(unit, [unit])):
            pytest.fail("package cycle: " + " -> ".join(cycle))


def test_this_checker_sees_the_kinds_of_import_it_judges() -> None:
    """Guards the test itself: known edges of each kind must be found."""
    assert ("layers", "spec") in EDGES  # a plain import
    assert ("spec", "schemas") in EDGES  # under TYPE_CHECKING only
    assert ("cli", "jobs") in EDGES  # inside a function
    assert ("__init__", "data") in EDGES  # `from factory import data`: the subpackage
