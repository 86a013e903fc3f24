"""Megatron-Core's per-module quantization recipe, from the blueprint's precision table.

A Megatron-Bridge mixed-precision preset applies one format to every linear
(``fp4="e2m1"``, ``fp4_recipe="nvfp4"``; BF16 for the first and last N layers).
The Nemotron 3 policies keep some modules in another format (Super: attention
and the LatentMoE projections in BF16, Mamba's ``out_proj`` in MXFP8).
Megatron-Core says that with ``TransformerConfig.quant_recipe``
(``megatron.core.quantization.quant_config.RecipeConfig``): named configs of
Transformer Engine parameters, and ordered glob matchers over the model's module
paths, the first match winning. A module no matcher names runs under the
global preset.

:func:`megatron_quant_recipe` writes that document (the YAML Megatron's
``RecipeConfig.from_yaml_file`` reads) for every GEMM whose format differs from
the preset's: the precision table's rows (``factory.precision.policy``), each
mapped to its Megatron module by the layer type's ``megatron_modules``
(``factory.layers``). Rows in BF16 because of ``precision.high_precision``
first/last are left to the preset's ``num_layers_at_{start,end}_in_bf16``.
Megatron fuses some of our GEMMs (Q, K and V; up and gate): they must share a
format. MTP layers are not matched here: the export says ``keep_mtp_spec_in_bf16``
when they are all BF16 and refuses other MTP formats.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from factory.layers.model_spec import model_spec
from factory.precision.policy import resolve_policy
from factory.schemas.blueprint import Blueprint
from factory.schemas.precision_recipes import recipe_named

__all__ = [
    "QUANT_RECIPE_FILE",
    "QUANT_RECIPE_LOADER",
    "MegatronQuantRecipe",
    "QuantRecipeError",
    "megatron_quant_recipe",
    "mtp_formats",
]

QUANT_RECIPE_FILE = "quant_recipe.yaml"
"""The export's file, beside recipe.py."""
QUANT_RECIPE_LOADER = "megatron.core.quantization.utils.load_quantization_recipe"
"""megatron-core's reader of that file into a ``RecipeConfig``."""

TE_CONFIG_TYPE = "TEQuantizationParams"
"""``transformer_engine_config_type`` of megatron-core's TE per-module parameters."""


class QuantRecipeError(ValueError):
    """A precision table Megatron's per-module recipe cannot say; ``problems`` names each."""

    def __init__(self, problems: list[tuple[str, str]]) -> None:
        self.problems = problems
        super().__init__("; ".join(f"{path}: {why}" for path, why in problems))


@dataclass(frozen=True)
class MegatronQuantRecipe:
    document: dict[str, Any]
    """``{"configs": ..., "matchers": ...}``: what ``RecipeConfig.from_config_dict`` takes."""
    modules: dict[str, str]
    """Megatron module path -> our format, for every module the matchers name."""
    mtp_formats: frozenset[str]
    """Formats of the MTP layers' GEMMs (the export maps all-BF16 to keep_mtp_spec_in_bf16)."""


def _format(bp: Blueprint, recipe: str) -> Mapping[str, str] | None:
    """Our format as megatron-core's ``TEQuantizationRecipe`` fields (``Fp4Recipe``/``Fp8Recipe``
    values; empty: the module runs in high precision), or None where it has none."""
    to_megatron = recipe_named(recipe).megatron
    if to_megatron is None:
        return None
    return to_megatron(bp.precision.options_for(recipe)).module_recipe


def mtp_formats(bp: Blueprint) -> set[str]:
    """The formats of the MTP layers' GEMMs (empty without MTP)."""
    return {row.recipe for row in resolve_policy(bp) if row.layer is None}


def _megatron_paths(bp: Blueprint) -> dict[str, str]:
    """Our GEMM name (``backbone.layers.3.mixer.q_proj``) -> Megatron module path."""
    paths = {}
    for layer in model_spec(bp.model).main_layers:
        for ours, theirs in layer.type.megatron_modules.items():
            paths[f"{layer.prefix}.{ours}"] = f"decoder.layers.{layer.index}.{theirs}"
    return paths


def megatron_quant_recipe(bp: Blueprint) -> MegatronQuantRecipe:
    """The per-module recipe of ``bp``'s precision table (see the module docstring); raises
    :class:`QuantRecipeError` naming every module it cannot express."""
    default = bp.precision.recipe
    paths = _megatron_paths(bp)
    per_module: dict[str, dict[str, str]] = {}  # Megatron module -> our GEMM -> format
    problems: list[tuple[str, str]] = []
    mtp: set[str] = set()
    for row in resolve_policy(bp):
        if row.layer is None:
            mtp.add(row.recipe)
        elif row.name not in paths:
            problems.append((row.name, "no Megatron module is known for this GEMM"))
        elif row.reason != "high_precision":
            per_module.setdefault(paths[row.name], {})[row.name] = row.recipe
    modules: dict[str, str] = {}
    for path, ours in sorted(per_module.items()):
        recipes = set(ours.values())
        if len(recipes) > 1:
            formats = ", ".join(f"{name} {recipe}" for name, recipe in sorted(ours.items()))
            problems.append((path, f"Megatron fuses these GEMMs into one: {formats}"))
            continue
        (recipe,) = recipes
        if recipe == default:
            continue
        if _format(bp, recipe) is None:
            problems.append((path, f"{recipe!r} has no Megatron per-module recipe"))
            continue
        modules[path] = recipe
    if problems:
        raise QuantRecipeError(problems)
    configs = {
        recipe: {"transformer_engine_config_type": TE_CONFIG_TYPE,
                 "training_recipe": _format(bp, recipe)}
        for recipe in sorted(set(modules.values()))
    }  # fmt: skip
    matchers = {
        f"m{i:04d}": {"type": "glob", "pattern": path, "config": recipe, "enabled": True}
        for i, (path, recipe) in enumerate(modules.items())
    }
    document = {"configs": configs, "matchers": matchers}
    return MegatronQuantRecipe(document, modules, frozenset(mtp))
