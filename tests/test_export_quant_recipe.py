"""The Megatron per-module quantization recipe, resolved by megatron-core 0.16.1 itself.

For Super and Ultra (whose NVFP4 policies keep attention and the LatentMoE
projections in BF16 and Mamba's out_proj in MXFP8) megatron-core's own
``RecipeConfig`` and ``TEQuantizationParams`` resolve every Megatron module of
the model to the format our precision table gives it; the module names are
ones megatron-core's hybrid layer specs and MoE layer build.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

import factory
from factory.exports.quant_recipe import QuantRecipeError, megatron_quant_recipe
from factory.layers.model_spec import model_spec
from factory.precision.policy import resolve_policy
from factory.schemas.blueprint import Blueprint

quant_config = pytest.importorskip("megatron.core.quantization.quant_config")
te_extension = pytest.importorskip("megatron.core.extensions.transformer_engine")
quant_utils = pytest.importorskip("megatron.core.quantization.utils")

FORMAT_OF = {None: "bf16", "nvfp4": "nvfp4", "mxfp8": "mxfp8"}


def _megatron_format(recipe: object) -> str:
    """Our format name for a parsed ``TEQuantizationRecipe``; its values must be members of
    megatron-core's ``Fp4Recipe`` / ``Fp8Recipe`` enums."""
    from megatron.core.enums import Fp4Recipe, Fp8Recipe

    fp4, fp8 = recipe.fp4_quantization_recipe, recipe.fp8_quantization_recipe  # type: ignore[attr-defined]
    if fp4 is not None:
        return FORMAT_OF[Fp4Recipe(fp4).value]
    return FORMAT_OF[Fp8Recipe(fp8).value if fp8 is not None else None]


@pytest.mark.parametrize("name", ["super", "ultra"])
def test_megatron_core_resolves_each_module_to_our_format(name: str) -> None:
    bp = factory.load_blueprint(name)
    recipe = quant_config.RecipeConfig.from_config_dict(megatron_quant_recipe(bp).document)
    ours = {row.name: row for row in resolve_policy(bp)}
    checked = 0
    for layer in model_spec(bp.model).main_layers:
        for gemm, module in layer.type.megatron_modules.items():
            row = ours.get(f"{layer.prefix}.{gemm}")
            if row is None:  # a GEMM this layer does not have (no gate with relu2)
                continue
            path = f"decoder.layers.{layer.index}.{module}"
            resolved = quant_utils.get_quant_config_or_none(path, recipe)
            if resolved is None:  # no matcher: the global preset (its BF16 first/last layers)
                expected = "bf16" if row.reason == "high_precision" else bp.precision.recipe
                assert row.recipe == expected, path
            else:
                params = te_extension.TEQuantizationParams.parse_from_config(resolved)
                assert _megatron_format(params.training_recipe) == row.recipe, path
            checked += 1
    assert checked > 100


def _names_built_by_megatron_core() -> set[str]:
    """Keyword and attribute names of megatron-core's hybrid layer specs and MoE modules."""
    root = Path(importlib.util.find_spec("megatron.core").origin).parent  # type: ignore[arg-type, union-attr]
    names: set[str] = set()
    for relative in ("models/mamba/mamba_layer_specs.py", "transformer/moe/moe_layer.py",
                     "transformer/moe/experts.py", "transformer/moe/shared_experts.py",
                     "transformer/transformer_layer.py"):  # fmt: skip
        tree = ast.parse((root / relative).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.keyword) and node.arg:
                names.add(node.arg)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
    return names


def test_every_megatron_module_name_is_one_megatron_core_builds() -> None:
    built = _names_built_by_megatron_core()
    for kind in {layer.type for layer in model_spec(factory.load_blueprint("super").model).layers}:
        for module in kind.megatron_modules.values():
            for part in module.split("."):
                assert part in built, f"{kind.name}: {module}: {part!r}"


def test_fused_gemms_in_different_formats_are_named() -> None:
    data = factory.load_blueprint("super").model_dump(exclude_unset=True)
    data["precision"]["overrides"]["*.mixer.k_proj"] = "mxfp8"
    with pytest.raises(QuantRecipeError) as refused:
        megatron_quant_recipe(Blueprint.model_validate(data))
    assert "self_attention.linear_qkv" in str(refused.value)
    assert "k_proj mxfp8" in str(refused.value)
