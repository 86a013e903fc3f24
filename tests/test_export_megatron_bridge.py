"""factory export megatron: every Megatron-Bridge name the recipe writes is Bridge's own.

Imports, ConfigContainer section classes, their fields and ``Literal`` values and the
mixed-precision presets of ``recipe.py`` and ``overrides.yaml`` are checked against
``megatron_bridge_fields.json``, which ``factory.exports.megatron_bridge_source`` reads from
Bridge's source (Bridge does not install on Python 3.11). These tests need neither
megatron-core nor Bridge installed.
"""

from __future__ import annotations

import ast
import json
import os
from pathlib import Path
from typing import Any

import pytest
import yaml
from blueprint_factory import make
from conftest import PRESETS, REPO
from megatron_exports import export_preset
from program_blueprints import STAGES, program

from factory.exports import megatron_bridge_source
from factory.exports.megatron import MegatronExportError, export_megatron
from factory.exports.megatron_fields import (
    BRIDGE_COMMIT,
    MEGATRON_LM_COMMIT,
    SECTIONS,
)
from factory.exports.megatron_recipe import _EXTRA_CLASSES

BRIDGE = json.loads((REPO / "factory/exports/megatron_bridge_fields.json").read_text())
NAMES = sorted(p.stem for p in PRESETS.glob("*.yaml"))


def _bridge_class(path: str) -> dict[str, Any]:
    return BRIDGE["classes"][path]


def _check_names(kind: str, path: str, names: dict[str, Any], problems: list[str]) -> int:
    """Each of ``names`` (field -> value) is an init field of Bridge's ``path``; a string
    value of a Literal field is one of its values. Returns how many names were checked."""
    cls = _bridge_class(path)
    for name, value in names.items():
        if name not in cls["fields"]:
            problems.append(f"{kind}: {name} is not a field of {path}")
        elif isinstance(value, str) and value not in cls["literals"].get(name, [value]):
            problems.append(f"{kind}: {name}={value!r} not in {cls['literals'][name]}")
    return len(names)


def bridge_problems(recipe: str, overrides: dict[str, Any]) -> tuple[list[str], int]:
    """Every Bridge name recipe.py and overrides.yaml use, against the checked-in JSON."""
    problems: list[str] = []
    tree = ast.parse(recipe)
    imported: dict[str, str] = {}
    # The fallback for an older Bridge is checked by running it (test_export_megatron_bridge_run).
    fallback = {
        id(sub) for h in ast.walk(tree) if isinstance(h, ast.ExceptHandler) for sub in ast.walk(h)
    }
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and id(node) not in fallback:
            exported = BRIDGE["modules"].get(node.module)
            for alias in node.names:
                imported[alias.asname or alias.name] = f"{node.module}.{alias.name}"
                bridge = node.module.startswith("megatron.bridge")
                if bridge and (exported is None or alias.name not in exported):
                    problems.append(f"import: {node.module} has no {alias.name}")
    classes = megatron_bridge_source.CLASSES
    checked = 0
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and ast.unparse(node.func) == "ConfigContainer":
            sections = {k.arg: k.value for k in node.keywords}
            checked += _check_names("container", classes["container"], sections, problems)
            for section, value in sections.items():
                if section == "mixed_precision":  # _mixed_precision(), checked below
                    continue
                if not isinstance(value, ast.Call) or section not in classes:
                    problems.append(f"{section}: not built from a class call")
                    continue
                cls = imported.get(ast.unparse(value.func))
                if cls != classes[section]:
                    problems.append(f"{section}: built from {cls}, Bridge wants {classes[section]}")
                kwargs = {
                    k.arg: k.value.value if isinstance(k.value, ast.Constant) else None
                    for k in value.keywords
                }
                checked += _check_names(section, classes[section], kwargs, problems)
        elif isinstance(node, ast.FunctionDef) and node.name == "_mixed_precision":
            for sub in ast.walk(node):
                if (
                    isinstance(sub, ast.Call)
                    and ast.unparse(sub.func) == "get_mixed_precision_config"
                ):
                    preset = sub.args[0].value  # type: ignore[attr-defined]
                    if preset not in BRIDGE["mixed_precision_presets"]:
                        problems.append(f"mixed_precision: no preset {preset!r}")
                    checked += 1
            sets = {
                t.attr: a.value.value if isinstance(a.value, ast.Constant) else None
                for a in ast.walk(node)
                if isinstance(a, ast.Assign)
                for t in a.targets
                if isinstance(t, ast.Attribute)
            }
            checked += _check_names("mixed_precision", classes["mixed_precision"], sets, problems)
    checked += _check_names("overrides", classes["container"], overrides, problems)
    for section, values in overrides.items():
        checked += _check_names(f"overrides.{section}", classes[section], values, problems)
    return problems, checked


@pytest.mark.parametrize("name", NAMES)
def test_every_bridge_name_is_in_bridge_source(name, tmp_path: Path):
    """Every recipe of the preset (one per stage for a program). An SFT stage's dataset
    (FinetuningDatasetConfig, PackedSequenceSpecs) is outside the checked-in JSON: the
    installed Bridge builds and validates it (test_export_megatron_program.py)."""
    for exported in export_preset(name, tmp_path / name):
        if exported.shape.entry == "finetune":
            continue
        overrides = yaml.safe_load((exported.folder / "overrides.yaml").read_text())
        problems, checked = bridge_problems(exported.recipe.read_text(), overrides)
        assert problems == [], exported.label
        # Every section keyword, every field of every section, twice (recipe and overrides).
        assert checked >= 2 * sum(len(v) for v in exported.shape.fields.values())


def test_a_program_chain_uses_only_bridge_names(tmp_path: Path):
    """The chain's keywords (pretrained_checkpoint, a resumed load, the scheduler override,
    a fully reshardable optimizer) are Bridge's own."""
    bp = program([STAGES[0], {**STAGES[1], "carry": {"optimizer": True}}, STAGES[2]])
    out = export_megatron(bp, tmp_path / "p")
    for stage in ("phase1", "phase2"):
        overrides = yaml.safe_load((out / stage / "overrides.yaml").read_text())
        recipe = (out / stage / "recipe.py").read_text()
        assert bridge_problems(recipe, overrides)[0] == []
    recipe = (out / "phase1" / "recipe.py").read_text()
    assert "dist_ckpt_optim_fully_reshardable=True" in recipe
    assert "override_opt_param_scheduler=True" in (out / "phase2" / "recipe.py").read_text()


def test_the_bridge_check_catches_what_the_old_export_wrote(tmp_path: Path):
    """Names written from memory before Bridge's source was read: each one is caught."""
    bp = make(**{"precision.recipe": "fp8"})
    recipe = (export_megatron(bp, tmp_path / "r", allow_unexpressed=True) / "recipe.py").read_text()
    old = recipe.replace("lr_wsd_decay_style", "lr_decay_wsd_style").replace(
        "get_mixed_precision_config('bf16_with_fp8", "get_mixed_precision_config('fp8"
    )
    old = old.replace("import CheckpointConfig,", "import CheckpointConfig, GPTDataConfig,")
    old = old.replace(" OptimizerConfig,", "")  # megatron-core's, as before
    old = "from megatron.core.optimizer import OptimizerConfig\n" + old
    problems, _ = bridge_problems(old, {"scheduler": {"lr_decay_style": "wsd"}})
    said = "\n".join(problems)
    assert "lr_decay_wsd_style is not a field" in said
    assert "no preset 'fp8" in said
    assert "has no GPTDataConfig" in said
    assert "optimizer: built from megatron.core.optimizer.OptimizerConfig" in said
    assert "lr_decay_style='wsd' not in" in said


def test_bridge_json_is_for_the_commits_and_classes_the_export_names():
    assert BRIDGE["megatron_bridge_commit"] == BRIDGE_COMMIT
    assert BRIDGE["megatron_lm_commit"] == MEGATRON_LM_COMMIT
    for section, (module, cls) in {**SECTIONS, **_EXTRA_CLASSES}.items():
        assert megatron_bridge_source.CLASSES[section] == f"{module}.{cls}"
    assert set(BRIDGE["classes"]) == set(megatron_bridge_source.CLASSES.values())


def test_energon_is_refused_because_bridge_energon_is_vision_language(tmp_path: Path):
    energon = _bridge_class(megatron_bridge_source.CLASSES["energon"])
    assert "task_encoder" in energon["fields"]  # the VLM task encoder the refusal names
    with pytest.raises(MegatronExportError, match="EnergonDatasetConfig") as exc:
        export_megatron(make(), tmp_path / "e", allow_unexpressed=True, data_format="energon")
    assert [p for p, _ in exc.value.fields] == ["data_format"]
    assert not (tmp_path / "e").exists()


def test_generator_follows_bases_reexports_and_init(tmp_path: Path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from pkg.child import Child as Exported\n")
    (pkg / "base.py").write_text(
        "from dataclasses import dataclass, field\nfrom typing import Literal\n"
        "@dataclass\nclass Base:\n    a: int\n    b: Literal['x', 'y'] | None = 'x'\n"
        "    c: int = field(init=False, default=0)\n"
    )
    (pkg / "child.py").write_text(
        "from .base import Base as B\nimport abc\n"
        "class Child(B, abc.ABC):\n    d: str = ''\n"
        "    def __init__(self, e=None, *args, **kwargs):\n        pass\n"
    )
    fields, read = megatron_bridge_source.SourceTree([tmp_path]).class_fields("pkg", "Exported")
    assert fields == {"a": None, "b": ["x", "y"], "d": None, "e": None}
    assert read == ["pkg.child.Child", "pkg.base.Base"]


@pytest.mark.skipif(
    "FACTORY_BRIDGE_SRC" not in os.environ, reason="set FACTORY_BRIDGE_SRC and FACTORY_MEGATRON_LM"
)
def test_bridge_json_regenerates_from_source():
    doc = megatron_bridge_source.bridge_fields(
        Path(os.environ["FACTORY_BRIDGE_SRC"]),
        Path(os.environ["FACTORY_MEGATRON_LM"]),
        BRIDGE_COMMIT,
        MEGATRON_LM_COMMIT,
    )
    assert doc == BRIDGE
