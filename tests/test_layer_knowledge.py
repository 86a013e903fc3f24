"""Layer knowledge stays in the layer folders: generic code loops over the layer registry.

Outside ``factory/layers/``, no source of ``factory/``, ``schemas/`` or ``kernels/`` imports
a layer type's folder, names a class defined there (``isinstance(m, MoE)``) or writes a
registered layer type's pattern symbol, name or title as a string of its own (``"*" in
pattern``, ``symbol == "E"``, ``{"mamba": ...}``): what a layer type means is asked of its
``LayerType``. Read from the syntax tree, so a symbol inside a longer string, a comment or an
f-string's text is no finding; ``ORDINARY`` lists the few strings elsewhere that equal one and
mean something else.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import factory.layers  # noqa: F401  (registers the built-in layer types)
from factory.spec.layer_type import LAYER_TYPES

ROOT = Path(__file__).resolve().parent.parent
SOURCES = [ROOT / "factory", ROOT / "schemas", ROOT / "kernels"]
LAYERS = ROOT / "factory" / "layers"

BUILT_IN = [kind for kind in LAYER_TYPES.values() if type(kind).__module__.startswith("factory.")]
SYMBOLS = {kind.symbol for kind in BUILT_IN}
WORDS = SYMBOLS | {kind.name for kind in BUILT_IN} | {kind.title or kind.name for kind in BUILT_IN}
FOLDERS = {Path(sys.modules[type(kind).__module__].__file__ or "").parent for kind in BUILT_IN}
PACKAGES = {".".join(folder.relative_to(ROOT).parts) for folder in FOLDERS}
CLASSES = {
    node.name
    for folder in FOLDERS
    for path in folder.rglob("*.py")
    for node in ast.walk(ast.parse(path.read_text()))
    if isinstance(node, ast.ClassDef)
}

ORDINARY: dict[tuple[str, str], str] = {
    **{
        ("schemas/pattern.py", word): "Megatron-Core's symbols and their layers, which the "
        "pattern rule names for a symbol factory does not build"
        for word in ("M", "*", "-", "E", "Mamba-2", "attention", "MLP")
    },
    ("schemas/base.py", "M"): "mega, a suffix of counts ('1M')",
    ("factory/report/units.py", "M"): "mega, a unit prefix",
    ("factory/report/units.py", "E"): "exa, a unit prefix",
    ("factory/loading/validation_errors.py", "M"): "a TypeVar's name",
    ("factory/io.py", "*"): "a file glob",
    ("factory/data/build_job.py", "*"): "a file glob",
    ("factory/report/build_folder.py", "*"): "a file glob",
    ("factory/runtime/loggers/wandb_log.py", "*"): "W&B's every-metric glob",
    ("factory/precision/policy.py", "*"): "any layer index in a GEMM's name",
    ("factory/cli/build_cmd.py", "-"): "the mark of a skipped stage",
    ("factory/report/run_page.py", "-"): "a missing value",
    ("factory/report/build_sections_stages.py", "-"): "a CSS class's word separator",
    ("factory/data/samples/text.py", "-"): "a URL slug's word separator",
    ("factory/data/samples/swe.py", "-"): "a test name's word separator",
}
"""(file, string) -> what that string means there instead."""


def findings(tree: ast.Module) -> list[tuple[int, str]]:
    """(line, what) for each piece of layer knowledge in a module outside the layer folders."""
    text = {id(part) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr)
            for part in node.values}  # fmt: skip
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and node.value in WORDS and id(node) not in text:
            found.append((node.lineno, f"the string {node.value!r}"))
        elif isinstance(node, ast.Name) and node.id in CLASSES:
            found.append((node.lineno, f"the layer class {node.id}"))
        elif isinstance(node, ast.Attribute) and node.attr in CLASSES:
            found.append((node.lineno, f"the layer class {node.attr}"))
        elif isinstance(node, ast.ImportFrom | ast.Import):
            base = f"{node.module}." if isinstance(node, ast.ImportFrom) and node.module else ""
            names = [f"{base}{alias.name}" for alias in node.names]
            if any(name == p or name.startswith(f"{p}.") for name in names for p in PACKAGES):
                found.append((node.lineno, "an import from a layer folder"))
    return sorted(found)


def _generic_sources() -> list[Path]:
    return [
        path
        for folder in SOURCES
        for path in sorted(folder.rglob("*.py"))
        if not path.is_relative_to(LAYERS)
    ]


def _all_findings() -> list[tuple[str, int, str]]:
    out = []
    for path in _generic_sources():
        where = path.relative_to(ROOT).as_posix()
        for line, what in findings(ast.parse(path.read_text())):
            out.append((where, line, what))
    return out


EXCUSED = {(file, f"the string {word!r}"): (file, word) for file, word in ORDINARY}


def test_no_layer_knowledge_outside_the_layer_folders() -> None:
    found = [f"{where}:{line}: {what}" for where, line, what in _all_findings()
             if (where, what) not in EXCUSED]  # fmt: skip
    assert found == []


def test_every_ordinary_string_is_still_there() -> None:
    """An entry of ORDINARY no source needs any more is taken out, so it excuses nothing new."""
    seen = {(where, what) for where, _, what in _all_findings()}
    assert [EXCUSED[key] for key in EXCUSED if key not in seen] == []


def test_this_checker_sees_layer_knowledge_and_ignores_text() -> None:
    """Guards the test itself, on what the upcycling and the proxy once held."""
    upcycle = """
from factory.layers.moe.module import MoE
_SYMBOLS = (("A_log", "M"), ("q_proj.weight", "*"))
moes = {name: m for name, m in model.named_modules() if isinstance(m, MoE)}
if block.symbol == "E" and found != "-":
    raise UpcycleError(f"an 'E' layer upcycles from the '-' layer")
"""
    assert [line for line, _ in findings(ast.parse(upcycle))] == [2, 3, 3, 4, 5, 5]
    proxy = 'periods = main.split("*") if "*" in main else [main]\nkept = "*".join(periods[:2])\n'
    assert [line for line, _ in findings(ast.parse(proxy))] == [1, 1, 2]
    import_kinds = "import factory.layers.mamba.module\nfrom factory.layers import attention\n"
    assert [line for line, _ in findings(ast.parse(import_kinds))] == [1, 2]
    hf = '_OLDER_NAMES = {"mamba": "linear_attention", "attention": "full_attention"}\n'
    assert [line for line, _ in findings(ast.parse(hf))] == [1, 1]
    text = 'note = f"{tp}*{cp} ranks, {n}-{m}"  # "*" and E in a comment\nwhy = "an E layer"\n'
    assert findings(ast.parse(text)) == []
    assert {"M", "*", "-", "E"} <= SYMBOLS and {"MoE", "MixtureOfExperts"} <= CLASSES
