"""The package's import graph: no cycles, and imports inside functions only where they pay.

A module-level import is an edge; importing ``factory.a.b`` also runs the
packages ``factory`` and ``factory.a`` first, so those are edges too. The
graph must have no cycle. Nor may files name each other in a loop by any
import statement, under ``TYPE_CHECKING`` or inside a function included: a
module reads as one thing built on the modules it names, never as half of a
pair. An import inside a function is allowed only for
torch or an optional extra that the importing module does not already pull in
(torch from a torch-free module, Transformer Engine, transformers, matplotlib
...), never to dodge a cycle, for the standard library or for a core
dependency (docs/architecture.md, "Imports inside functions").
"""

from __future__ import annotations

import ast
import sys
from functools import cache
from pathlib import Path

import pytest

from factory.schemas.trackers import TRACKERS

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {
    "factory": ROOT / "factory",
    "factory.schemas": ROOT / "schemas",
    "factory.kernels": ROOT / "kernels",
    "factory.blueprints": ROOT / "blueprints",
    "factory.data_recipes": ROOT / "data_recipes",
}
HEAVY = {
    "torch", "transformers", "transformer_engine", "mamba_ssm", "triton", "matplotlib", "numpy",
    "tokenizers", "safetensors", "webdataset", "pyarrow", "datasets", "ray", "megatron",
    "megatron_energon", "xxhash", "jsonschema", "hypothesis", "numba", "omegaconf", "jinja2",
} | {entry.package for entry in TRACKERS.values() if entry.package}  # fmt: skip
"""Third-party packages worth deferring: torch, the optional extras, the experiment trackers'
(from their registry), and OmegaConf, which only a blueprint that interpolates or takes
``--set`` overrides needs (``factory/loading/compose.py``; no preset does, and importing it
cost ``factory validate`` a sixth of its time). The other core dependencies (pydantic, PyYAML,
typer, rich) are imported at the top: ``import factory`` and the commands load them anyway."""


def _modules() -> dict[str, Path]:
    found = {}
    for prefix, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([prefix, *parts])] = path
    return found


MODULES = _modules()


def _resolve(name: str, level: int, module: str, is_package: bool) -> str:
    if not level:
        return name
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join([*base, name] if name else base)


def _targets(node: ast.Import | ast.ImportFrom, module: str) -> list[str]:
    """Fully qualified modules an import statement loads."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    is_package = MODULES[module].name == "__init__.py"
    base = _resolve(node.module or "", node.level, module, is_package)
    sub = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in MODULES]
    return [base, *sub]


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


@cache
def _imports(module: str) -> tuple[list[str], list[tuple[int, str]]]:
    """(module-level targets, [(line, target)] of imports inside functions)."""
    tree = ast.parse(MODULES[module].read_text(encoding="utf-8"))
    top: list[str] = []
    inner: list[tuple[int, str]] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                continue
            if isinstance(child, ast.Import | ast.ImportFrom):
                for target in _targets(child, module):
                    if in_function:
                        inner.append((child.lineno, target))
                    else:
                        top.append(target)
            nested = isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
            visit(child, in_function or nested)

    visit(tree, False)
    return top, inner


def _ancestors(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1)]


def _edges(module: str) -> set[str]:
    """Modules importing ``module`` runs: each target and the packages above it, except the
    packages ``module`` itself sits in (those are already running when it is imported)."""
    own = set(_ancestors(module))
    out = set()
    for target in _imports(module)[0]:
        out |= {a for a in _ancestors(target) if a in MODULES and a not in own}
    return out


@cache
def _loads(module: str) -> frozenset[str]:
    """Heavy third-party packages importing ``module`` loads, transitively."""
    seen: set[str] = set()
    stack, heavy = [module], set()
    while stack:
        current = stack.pop()
        if current in seen:
            continue
        seen.add(current)
        for target in _imports(current)[0]:
            root = target.split(".")[0]
            if root in HEAVY:
                heavy.add(root)
        stack.extend(_edges(current))
    return frozenset(heavy)


def test_the_import_graph_has_no_cycle() -> None:
    graph = {module: _edges(module) for module in MODULES}
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = 2
        path.pop()
        return None

    for module in sorted(graph):
        if module not in state and (cycle := visit(module)):
            pytest.fail("import cycle: " + " -> ".join(cycle))


def _named_modules(module: str) -> set[str]:
    """The factory modules any import statement in ``module`` names, wherever it stands:
    ``from package import submodule`` names the submodule alone."""
    named = set()
    for node in ast.walk(ast.parse(MODULES[module].read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            named |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base, *submodules = _targets(node, module)
            named |= set(submodules)
            if len(submodules) < len(node.names):  # it takes names defined in ``base``
                named.add(base)
    return {target for target in named if target in MODULES and target != module}


def _file_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The groups of modules that reach one another through ``graph`` (Tarjan's strongly
    connected components of more than one module)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = stack[stack.index(node) :]
            del stack[stack.index(node) :]
            if len(group) > 1:
                groups.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return groups


def test_no_files_name_each_other_in_a_loop() -> None:
    graph = {module: _named_modules(module) for module in MODULES}
    loops = [
        " <-> ".join(str(MODULES[m].relative_to(ROOT)) for m in group)
        for group in _file_cycles(graph)
    ]
    assert loops == []


def _offences() -> list[str]:
    offences = []
    for module in sorted(MODULES):
        own = _loads(module)
        for line, target in _imports(module)[1]:
            root = target.split(".")[0]
            where = f"{MODULES[module].relative_to(ROOT)}:{line}: {target}"
            if target in MODULES:
                if not (_loads(target) - own):
                    offences.append(f"{where} (loads nothing heavy that {module} lacks)")
            elif target.startswith("factory."):
                offences.append(f"{where} (no such module)")
            elif root not in HEAVY:
                offences.append(f"{where} (standard library or light: import it at the top)")
            elif root in own:
                offences.append(f"{where} ({module} already imports {root})")
    return offences


def test_imports_inside_functions_are_only_for_heavy_or_optional_dependencies() -> None:
    assert _offences() == []


def test_this_checker_sees_the_kinds_of_import_it_judges() -> None:
    """Guards the test itself: a sample of known edges and lazy imports must be found."""
    assert "factory.spec.layer_type" in _edges("factory.layers.mamba.spec")
    assert "torch" in _loads("factory.graph.hybrid_lm")
    assert "torch" not in _loads("factory.planner.plan")
    assert "tensorboard" in _loads("factory.runtime.loggers.tensorboard_log")  # from TRACKERS
    lazy = dict((t, line) for line, t in _imports("factory.jobs.train")[1])
    assert "factory.jobs.train_rank" in lazy
    assert "factory.runtime.step" in _named_modules("factory.runtime.callbacks")  # TYPE_CHECKING
    assert "factory.jobs.train_rank" in _named_modules("factory.jobs.train")  # in a function
    assert _file_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert sys.modules  # the checker never imports what it judges
