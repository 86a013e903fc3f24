"""factory export megatron: every field we write is megatron-core 0.16.1's, and it accepts them.

The megatron-core tests skip where it is not installed (it is a dev extra). The pattern is
checked with megatron-core's own allocation and pipeline-stage selection; the recipe is
parsed and may use no keyword outside the one mapping table. Bridge-side names are checked
in ``test_export_megatron_bridge.py``.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import json
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml
from blueprint_factory import make
from conftest import PRESETS, REPO
from megatron_exports import export_preset

import factory
import factory.exports.megatron as megatron_export
from factory.checks import run_rules
from factory.exports.megatron_fields import (
    SECTIONS,
    Call,
    Ref,
    fields,
    megatron_fields,
    pipeline_stage_sizes,
)
from factory.exports.megatron_recipe import _EXTRA_CLASSES
from factory.exports.megatron_refusals import refusals
from factory.layers.mamba.spec import MEGATRON_MIXER_DEFAULTS
from factory.schemas.model import MambaConfig

try:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Transformer Engine and Apex are not installed"
        from megatron.core.distributed import DistributedDataParallelConfig
        from megatron.core.models.mamba.mamba_model import MambaModel
        from megatron.core.optimizer import OptimizerConfig
        from megatron.core.ssm.mamba_block import MambaStack
        from megatron.core.ssm.mamba_hybrid_layer_allocation import allocate_layers
        from megatron.core.transformer.transformer_config import TransformerConfig
except ImportError:  # a dev extra: the Bridge-name tests below still run
    TransformerConfig = None  # type: ignore[assignment,misc]
needs_core = pytest.mark.skipif(TransformerConfig is None, reason="megatron-core not installed")
BRIDGE = json.loads((REPO / "factory/exports/megatron_bridge_fields.json").read_text())

NAMES = sorted(p.stem for p in PRESETS.glob("*.yaml"))
FIELDS = fields()
KINDS = {f.name: f.kind for f in FIELDS if f.section == "model"}


def _resolve(value: Any) -> Any:
    if isinstance(value, Ref):
        module, name = value.path.rsplit(".", 1)
        return getattr(importlib.import_module(module), name)
    return value


def _config(bp) -> Any:
    model = megatron_fields(bp)["model"]
    kwargs = {k: _resolve(v) for k, v in model.items() if KINDS[k] == "config"}
    return TransformerConfig(**kwargs)


def _stages(bp) -> list[str]:
    """What megatron-core's MambaStack builds on each pipeline rank of ``bp``."""
    config = _config(bp)
    main = bp.model.parsed_pattern.main
    types = allocate_layers(config.num_layers, 0.0, 0.0, main)
    assert "".join(types) == main
    pp = config.pipeline_model_parallel_size
    if pp == 1:
        return [main]
    out = []
    for rank in range(pp):
        group = SimpleNamespace(rank=lambda r=rank: r, size=lambda: pp)
        stack = SimpleNamespace(config=config, pp_group=group)
        _, selected = MambaStack._select_layers_for_pipeline_parallel(stack, types)
        out.append("".join(selected))
    return out


@needs_core
def test_every_field_exists_in_megatron_core():
    config = {f.name for f in dataclasses.fields(TransformerConfig)}
    model = set(inspect.signature(MambaModel.__init__).parameters)
    core_sections = {"optimizer": OptimizerConfig, "ddp": DistributedDataParallelConfig}
    for f in FIELDS:
        if f.kind == "config":
            assert f.name in config, f"{f.name} is not a TransformerConfig field"
        elif f.kind == "model":
            assert f.mcore in model, f"{f.mcore} is not a MambaModel parameter"
        if f.section in core_sections:
            names = {x.name for x in dataclasses.fields(core_sections[f.section])}
            assert f.name in names, f"{f.name} is not a {f.section} field"


@needs_core
@pytest.mark.parametrize("name", NAMES)
def test_transformer_config_accepts_every_preset(name):
    bp = factory.load_blueprint(name, [])
    config = _config(bp)
    assert config.num_layers == bp.model.num_layers
    stages = _stages(bp)
    assert "".join(stages) == bp.model.parsed_pattern.main
    assert [len(s) for s in stages] == pipeline_stage_sizes(bp)


@needs_core
def test_a_pattern_without_attention_or_mlps_gets_what_megatron_requires():
    bp = make(**{"model.pattern": "MMMM"})
    model = megatron_fields(bp)["model"]
    required = ("num_attention_heads", "add_bias_linear", "activation_func", "gated_linear_unit")
    assert [model[name] for name in required] == [
        1,
        False,
        Ref("megatron.core.activations.squared_relu"),
        False,
    ]
    assert _config(bp).num_attention_heads == 1


@needs_core
def test_uneven_pipeline_cuts_are_built_stage_by_stage():
    bp = make(**{"model.pattern": "M*M|E-M*ME", "parallelism.pp": 2})
    assert refusals(bp) == []
    assert _stages(bp) == ["M*M", "E-M*ME"]


@needs_core
def test_first_and_last_stages_may_differ_from_an_even_middle():
    bp = make(**{"model.pattern": "M*|ME|-M|*ME", "parallelism.pp": 4})
    assert refusals(bp) == []
    assert _stages(bp) == ["M*", "ME", "-M", "*ME"]


@needs_core
def test_cuts_megatron_cannot_make_are_refused_first():
    bp = make(**{"model.pattern": "M*|ME-|M*|ME", "parallelism.pp": 4})
    [(path, why)] = refusals(bp)
    assert path == "model.pattern" and "[2, 3, 2, 2]" in why
    with pytest.raises(ValueError, match="middle stage: 5 must be divisible"):
        _config(bp)  # what megatron-core says when handed the nearest first/last split


def test_virtual_pipeline_stages_are_refused():
    bp = make(**{"model.pattern": "M*|ME|-M|*M", "parallelism.pp": 2})
    assert [p for p, _ in refusals(bp)] == ["parallelism.vpp"]


def _recipe_calls(tree: ast.Module, sections: dict[str, tuple[str, str]]) -> dict[str, ast.Call]:
    classes = {cls: section for section, (_, cls) in sections.items()}
    calls = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            if node.func.id in classes:
                calls[classes[node.func.id]] = node
            elif node.func.id == "ConfigContainer":
                calls["container"] = node
    return calls


@pytest.mark.parametrize("name", NAMES)
def test_recipe_compiles_and_names_only_mapped_fields(name, tmp_path: Path):
    """Every recipe of the preset (one per stage for a program) uses only the mapping's
    fields and the recipe's own keywords, and overrides.yaml carries the same values."""
    mapped: dict[str, set[str]] = {}
    for f in FIELDS:
        mapped.setdefault(f.section, set()).add(f.name)
    for exported in export_preset(name, tmp_path / name):
        out, shape = exported.folder, exported.shape
        source = exported.recipe.read_text()
        compile(source, "recipe.py", "exec")
        calls = _recipe_calls(ast.parse(source), shape.classes)
        container = {k.arg for k in calls.pop("container").keywords}
        assert container == set(SECTIONS) | set(_EXTRA_CLASSES)
        for section, call in calls.items():
            used = {k.arg for k in call.keywords}
            allowed = mapped.get(section, set()) | set(shape.keywords.get(section, {}))
            allowed |= set(shape.fields.get(section, {}))  # a stage's finetune dataset
            assert used <= allowed, (exported.label, section, used - allowed)
        # overrides.yaml carries the same values, and hf/ the HF writer's config.
        doc = yaml.safe_load((out / "overrides.yaml").read_text())
        fields = shape.fields
        assert f"Bridge's {fields['mixed_precision']['name']} preset" in source
        for section, values in fields.items():
            as_yaml = {
                Ref: lambda v: {"_target_": v.path, "_call_": False},
                Call: lambda v: {"_target_": v.path, "recipe_path": v.file},
            }
            expect = {
                k: as_yaml[type(v)](v) if type(v) in as_yaml else v
                for k, v in values.items()
                if (section, k) != ("mixed_precision", "name")  # recipe.py's starting preset
            }
            assert doc[section] == expect
        assert (out / "hf" / "config.json").exists()
        assert "srun" in (out / "launch.sh").read_text()


def test_docs_carry_the_mapping_table():
    assert megatron_export.mapping_markdown() in (REPO / "docs" / "megatron.md").read_text()


@needs_core
def test_validate_refuses_moe_biases_with_etp_before_megatron_does():
    bp = make(**{"model.mlp.bias": True, "model.attention.bias": True, "parallelism.etp": 2})
    said = [(r.name, f.message) for r, f in run_rules(bp) if f.severity == "error"]
    assert any(n == "parallelism.moe_bias_etp" and "etp=2" in m for n, m in said), said
    with pytest.raises(AssertionError, match="Bias in Moe is only supported when ETP==1"):
        _config(bp)


def test_export_refuses_what_megatron_cannot_express(cli, tmp_path: Path):
    status, _, err = cli(
        "export",
        "megatron",
        "nano",
        "--out",
        str(tmp_path / "x"),
        "--set",
        "model.mamba.conv_kernel=3",
        "--set",
        "model.moe.router.normalize_top_k=false",
    )
    assert status == 2
    assert "model.mamba.conv_kernel" in err and "fixed at 4" in err
    assert "model.moe.router.normalize_top_k" in err and "renormalises" in err
    assert not (tmp_path / "x").exists()


def test_super_exports_its_per_module_formats_as_a_quant_recipe(cli, tmp_path: Path):
    """Super's overrides (attention, LatentMoE and MTP in BF16, Mamba out_proj in MXFP8) are a
    quant_recipe.yaml that recipe.py loads; MTP all in BF16 is keep_mtp_spec_in_bf16."""
    status, _, err = cli(
        "export", "megatron", "super", "--out", str(tmp_path / "s"), "--allow-unexpressed"
    )
    assert status == 0, err
    stages = factory.load_blueprint("super", []).stages
    folder = tmp_path / "s" / (stages[0].name if stages else "")  # a program's first stage
    recipe = (folder / "recipe.py").read_text()
    assert "quant_recipe=load_quantization_recipe(" in recipe
    assert "keep_mtp_spec_in_bf16=True" in recipe
    document = yaml.safe_load((folder / "quant_recipe.yaml").read_text())
    patterns = {m["pattern"]: m["config"] for m in document["matchers"].values()}
    assert patterns["decoder.layers.0.mixer.out_proj"] == "mxfp8"  # layer 0 is Mamba
    readme = (folder / "README.md").read_text()
    assert "training.stability" in readme
    assert "(refused unless --allow-unexpressed)\n\n- none\n" in readme  # all expressed


def test_fused_gemms_in_two_formats_are_refused_naming_the_module(cli, tmp_path: Path):
    status, _, err = cli(
        "export", "megatron", "super", "--out", str(tmp_path / "s"),
        "--set", "precision.overrides={'*.mixer.k_proj': 'mxfp8'}",
    )  # fmt: skip
    assert status == 2
    assert "self_attention.linear_qkv" in err


def test_the_mamba_defaults_megatron_fixes_are_fields_of_the_mamba_section():
    assert set(MEGATRON_MIXER_DEFAULTS) <= set(MambaConfig.model_fields)
