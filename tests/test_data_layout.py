"""``factory/data`` is organised by role, and its imports keep it so.

``steps`` (one record or document) and ``shards`` (the published files) import no
other part of the package; ``stages`` use both; ``executors`` run the stages; the
top-level modules (the build job, the recipe loader) use them all. Nothing in data
imports the training side or above it (runtime, distributed, jobs, report, cli),
and every module's name is used once in factory.
"""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "factory" / "data"
MAY_IMPORT = {
    "steps": {"steps"},
    "shards": {"shards"},
    "stages": {"stages", "steps", "shards"},
    "executors": {"executors", "stages", "steps", "shards"},
}
"""The parts of factory.data each subpackage may import (samples/ is the shipped corpus's
generator and imports only itself)."""
ABOVE_DATA = {"runtime", "distributed", "jobs", "report", "cli", "exports"}


def _part(module: str) -> str:
    """The part of factory.data that ``module`` (dotted) is in: a subpackage, or 'top'."""
    name = module.split(".")[2] if module.count(".") >= 2 else ""
    return name if name in {*MAY_IMPORT, "samples"} else "top"


def _imports(path: Path) -> list[str]:
    return [
        node.module
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, ast.ImportFrom) and node.module
    ] + [
        alias.name
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, ast.Import)
        for alias in node.names
    ]


def test_each_part_imports_only_the_parts_below_it() -> None:
    wrong = []
    for path in sorted(DATA.rglob("*.py")):
        part = _part("factory.data." + ".".join(path.relative_to(DATA).with_suffix("").parts))
        allowed = MAY_IMPORT.get(part, {"samples"} if part == "samples" else None)
        for module in _imports(path):
            if not module.startswith("factory.data."):
                continue
            if allowed is not None and _part(module) not in allowed:
                wrong.append(f"{path.relative_to(ROOT)}: {part} imports {module}")
    assert wrong == []


def test_data_imports_nothing_from_the_training_side_or_above() -> None:
    wrong = [
        f"{path.relative_to(ROOT)}: {module}"
        for path in sorted(DATA.rglob("*.py"))
        for module in _imports(path)
        if module.startswith("factory.") and module.split(".")[1] in ABOVE_DATA
    ]
    assert wrong == []


def test_every_data_module_name_is_used_once() -> None:
    stems = Counter(
        path.stem
        for folder in ("factory", "schemas", "kernels")
        for path in (ROOT / folder).rglob("*.py")
        if path.stem not in {"__init__", "__main__"}
    )
    repeated = sorted(
        str(path.relative_to(ROOT))
        for path in DATA.rglob("*.py")
        if path.stem not in {"__init__", "__main__"} and stems[path.stem] > 1
    )
    assert repeated == []
