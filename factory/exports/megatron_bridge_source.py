"""Megatron-Bridge's config field names, read from its source with ``ast``.

Megatron-Bridge needs Python >= 3.12 and a CUDA stack, so this repository cannot import it;
instead ``bridge_fields`` parses a checkout of its ``src/`` (plus the Megatron-LM submodule it
pins, whose ``megatron.training.config`` and ``megatron.core`` hold most base classes) and
writes every init field of the classes ``recipe.py`` builds. The result is checked in as
``megatron_bridge_fields.json``; ``tests/test_export_megatron.py`` compares every name the
export writes with it, so the check runs in CI without Bridge.

Regenerate (bare mirrors work through ``git archive``; plain checkouts are passed as is)::

    python -m factory.exports.megatron_bridge_source BRIDGE_SRC MEGATRON_LM_ROOT \\
        --bridge-commit SHA --megatron-lm-commit SHA > factory/exports/megatron_bridge_fields.json
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["CLASSES", "MODULES", "SourceTree", "bridge_fields"]

# Every class recipe.py builds or names, by import path. "container" is ConfigContainer
# itself; its fields are the section keywords.
CLASSES: dict[str, str] = {
    "container": "megatron.bridge.training.config.ConfigContainer",
    "model": "megatron.bridge.models.hybrid.hybrid_provider.HybridModelProvider",
    "train": "megatron.bridge.training.config.TrainingConfig",
    "optimizer": "megatron.bridge.training.config.OptimizerConfig",
    "scheduler": "megatron.bridge.training.config.SchedulerConfig",
    "ddp": "megatron.bridge.training.config.DistributedDataParallelConfig",
    "dataset": "megatron.bridge.training.config.GPTDatasetConfig",
    "energon": "megatron.bridge.data.builders.energon.EnergonDatasetConfig",
    "checkpoint": "megatron.bridge.training.config.CheckpointConfig",
    "rng": "megatron.bridge.training.config.RNGConfig",
    "logger": "megatron.bridge.training.config.LoggerConfig",
    "tokenizer": "megatron.bridge.training.config.TokenizerConfig",
    "dist": "megatron.bridge.training.config.DistributedInitConfig",
    "mixed_precision": "megatron.bridge.training.mixed_precision.MixedPrecisionConfig",
}
# Modules whose top-level names are recorded, so the test can check recipe.py's imports.
MODULES = (
    "megatron.bridge.training.config",
    "megatron.bridge.training.mixed_precision",
    "megatron.bridge.models.hybrid.hybrid_provider",
    "megatron.bridge.data.builders.energon",
    "megatron.bridge.training.gpt_step",
    "megatron.bridge.training.pretrain",
)


@dataclass
class _Module:
    tree: ast.Module
    imports: dict[str, tuple[str, str]] = field(default_factory=dict)  # local -> (module, name)
    classes: dict[str, ast.ClassDef] = field(default_factory=dict)


class SourceTree:
    """Python modules under some roots, parsed lazily and never imported."""

    def __init__(self, roots: list[Path]) -> None:
        self.roots = roots
        self._cache: dict[str, _Module | None] = {}

    def module(self, name: str) -> _Module | None:
        if name not in self._cache:
            self._cache[name] = self._load(name)
        return self._cache[name]

    def _load(self, name: str) -> _Module | None:
        rel = Path(*name.split("."))
        for root in self.roots:
            for path in (root / rel.with_suffix(".py"), root / rel / "__init__.py"):
                if path.is_file():
                    return self._parse(name, path, is_package=path.name == "__init__.py")
        return None  # outside the roots: stdlib, torch, ... (never a config base we need)

    @staticmethod
    def _parse(name: str, path: Path, is_package: bool) -> _Module:
        mod = _Module(ast.parse(path.read_text(), str(path)))
        package = name if is_package else name.rpartition(".")[0]
        for node in mod.tree.body:
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative import: resolve against this module's package
                    parts = package.split(".")
                    parts = parts[: len(parts) - node.level + 1]
                    base = ".".join(parts + ([node.module] if node.module else []))
                for alias in node.names:
                    mod.imports[alias.asname or alias.name] = (base, alias.name)
            elif isinstance(node, ast.ClassDef):
                mod.classes[node.name] = node
        return mod

    def find_class(self, module: str, name: str, depth: int = 0) -> tuple[str, ast.ClassDef] | None:
        """The class ``name`` as ``module`` sees it, following re-exports."""
        mod = self.module(module)
        if mod is None or depth > 20:
            return None
        if name in mod.classes:
            return module, mod.classes[name]
        if name in mod.imports:
            src, orig = mod.imports[name]
            found = self.find_class(src, orig, depth + 1)
            if found is None and self.module(f"{src}.{orig}") is not None:
                return None  # a submodule, not a class
            return found
        return None

    def top_level_names(self, module: str) -> list[str]:
        mod = self.module(module)
        if mod is None:
            raise FileNotFoundError(f"module {module} not found under {self.roots}")
        names = set(mod.imports) | set(mod.classes)
        for node in mod.tree.body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                names.add(node.name)
            elif isinstance(node, ast.Assign):
                names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names.add(node.target.id)
        return sorted(names)

    def class_fields(self, module: str, name: str) -> tuple[dict[str, list[str] | None], list[str]]:
        """Init field -> its Literal values (None if not a Literal), and the classes read."""
        found = self.find_class(module, name)
        if found is None:
            raise LookupError(f"class {name} not found from {module}")
        where, cls = found
        out: dict[str, list[str] | None] = {}
        read = [f"{where}.{cls.name}"]
        for base in cls.bases:  # base fields first, as dataclasses order them
            base_name = _base_name(base)
            if base_name is None:
                continue
            module_of, local = where, base_name
            if "." in base_name:  # alias.Class, where ``from pkg import alias``
                head, _, local = base_name.rpartition(".")
                src = self.module(where).imports.get(head)  # type: ignore[union-attr]
                module_of = f"{src[0]}.{src[1]}" if src else head
            if self.find_class(module_of, local) is None:
                continue  # ABC, Generic, torch.nn.Module, ...: no dataclass fields
            fields, bases_read = self.class_fields(module_of, local)
            out |= fields
            read += bases_read
        for node in cls.body:
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                if _init_false(node.value) or _is_classvar(node.annotation):
                    out.pop(node.target.id, None)
                else:
                    out[node.target.id] = _literals(node.annotation)
            elif isinstance(node, ast.FunctionDef) and node.name == "__init__":
                # An explicit __init__ (GPTDatasetConfig) takes keywords besides the fields.
                args = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
                for arg in args[1:]:
                    out.setdefault(arg.arg, _literals(arg.annotation))
        return out, read


def _base_name(node: ast.expr) -> str | None:
    if isinstance(node, ast.Subscript):  # ModelProviderMixin[MCoreHybridModel]
        node = node.value
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return ast.unparse(node)
    return None


def _init_false(value: ast.expr | None) -> bool:
    return isinstance(value, ast.Call) and any(
        k.arg == "init" and isinstance(k.value, ast.Constant) and k.value.value is False
        for k in value.keywords
    )


def _is_classvar(annotation: ast.expr) -> bool:
    return "ClassVar" in ast.unparse(annotation)


def _literals(annotation: ast.expr | None) -> list[str] | None:
    """The string values of a ``Literal[...]`` annotation (also inside ``| None``)."""
    if annotation is None:
        return None
    values: list[str] = []
    for node in ast.walk(annotation):
        if isinstance(node, ast.Subscript) and ast.unparse(node.value).endswith("Literal"):
            values += [
                c.value
                for c in ast.walk(node.slice)
                if isinstance(c, ast.Constant) and isinstance(c.value, str)
            ]
    return values or None


def _presets(tree: SourceTree) -> list[str]:
    """Names of the functions ``mixed_precision.py`` registers with ``@register``."""
    mod = tree.module("megatron.bridge.training.mixed_precision")
    if mod is None:
        raise FileNotFoundError("megatron/bridge/training/mixed_precision.py not found")
    return sorted(
        node.name
        for node in mod.tree.body
        if isinstance(node, ast.FunctionDef)
        and any(isinstance(d, ast.Name) and d.id == "register" for d in node.decorator_list)
    )


def bridge_fields(
    bridge_src: Path, megatron_lm: Path, bridge_commit: str, megatron_lm_commit: str
) -> dict[str, Any]:
    """The JSON document: per class its init fields (and Literal values), the mixed-precision
    presets, and the top-level names of the modules recipe.py imports from."""
    tree = SourceTree([bridge_src, megatron_lm])
    classes: dict[str, Any] = {}
    for path in sorted(set(CLASSES.values())):
        module, _, name = path.rpartition(".")
        fields, read = tree.class_fields(module, name)
        classes[path] = {
            "read": read,
            "fields": sorted(fields),
            "literals": {k: v for k, v in sorted(fields.items()) if v},
        }
    return {
        "megatron_bridge_commit": bridge_commit,
        "megatron_lm_commit": megatron_lm_commit,
        "classes": classes,
        "mixed_precision_presets": _presets(tree),
        "modules": {m: tree.top_level_names(m) for m in MODULES},
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("bridge_src", type=Path, help="Megatron-Bridge checkout's src/")
    parser.add_argument("megatron_lm", type=Path, help="Megatron-LM checkout (its pinned commit)")
    parser.add_argument("--bridge-commit", required=True)
    parser.add_argument("--megatron-lm-commit", required=True)
    args = parser.parse_args(argv)
    doc = bridge_fields(
        args.bridge_src, args.megatron_lm, args.bridge_commit, args.megatron_lm_commit
    )
    sys.stdout.write(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
