"""The precision-recipe registry: one registered record per recipe name.

A :class:`PrecisionRecipe` is everything factory knows about one format a GEMM
can run in (``bf16``, ``fp8``, ``nvfp4``, ``mxfp8``, ``mor``, or one you add):
whether it quantizes, how many elements share a scale along a GEMM dimension
(what a tensor-parallel split must keep whole), the bytes Transformer Engine
keeps of a quantized GEMM's input, the tensor-core format whose peak it runs
at, its Transformer Engine and Megatron names, its own validate rules and the
colour pictures draw it in. The schema (the names ``precision.recipe`` and
``precision.overrides`` accept), the policy, the planner, the checks, the
exports and the report read it; none of them asks which recipe it holds.

Its torch side, the quantizer, is named by import path and imported on first
use (``factory.precision.quantizers.make_quantizer``), and its Transformer
Engine recipe is built from TE's module, which the caller imports, so a record
and everything that reads it stay torch-free. ``CONTRIBUTING.md`` ("Adding a
precision recipe") walks through adding one.

This module names no other module of factory, so the schema can ask it which
names exist: what its callables receive (the blueprint, its ``precision``
section, a recipe's settings section) is typed ``Any`` here and exactly in each
recipe's module.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "PRECISION_RECIPES",
    "MegatronPreset",
    "PrecisionRecipe",
    "RecipeCheck",
    "RecipeFinding",
    "recipe_named",
    "recipes_revision",
    "register_recipe",
    "unregister_recipe",
]

PRECISION_RECIPES: dict[str, PrecisionRecipe] = {}
"""Registered recipes by name, in registration order (the order the JSON Schema lists them).
Change it through :func:`register_recipe` and :func:`unregister_recipe`."""

_revision = 0

RecipeFinding = tuple[str, str] | tuple[str, str, str]
"""What a recipe's check yields: (blueprint path, message), or with a third item
``"warning"`` for a finding that does not fail validation."""


@dataclass(frozen=True)
class RecipeCheck:
    """A validate rule of one recipe's own, run when it is the blueprint's ``precision.recipe``."""

    name: str
    """The rule's name (``factory validate --rules`` lists it)."""
    check: Callable[[Any], Iterator[RecipeFinding]]
    """The ``Blueprint`` -> its findings; the function's docstring's first line is the
    summary."""


@dataclass(frozen=True)
class MegatronPreset:
    """How Megatron-Bridge and megatron-core name one recipe with its settings."""

    name: str
    """Bridge's mixed-precision preset (``training/mixed_precision.py``)."""
    fields: Mapping[str, str] = field(default_factory=dict)
    """The preset's ``MixedPrecisionConfig`` fields that name the format (``fp8``,
    ``fp8_recipe``, ``fp4``, ``fp4_recipe``), as the export writes them."""
    module_recipe: Mapping[str, str] | None = None
    """megatron-core's ``TEQuantizationRecipe`` fields of one module in this format (the
    export's ``quant_recipe.yaml``); None where Megatron has no per-module recipe for it."""


def _per_tensor(options: Any) -> int:
    return 1


def _nothing_refused(precision: Any) -> list[tuple[str, str]]:
    return []


def _no_gemm_wired(options: Any) -> str | None:
    return "no tensor-core GEMM is wired for it"


@dataclass(frozen=True)
class PrecisionRecipe:
    """One recipe, torch-free. Callables take the recipe's own settings section
    (``precision.<options>``; None for a recipe without one)."""

    name: str
    """As blueprints write it (``precision.recipe``, ``precision.overrides``)."""
    title: str
    """As messages name it ('NVFP4', 'Mixture of Representations')."""
    quantizes: bool
    """False for the recipe that runs GEMMs unquantized (``bf16``, which
    ``precision.high_precision`` layers keep)."""
    peak_format: str
    """The tensor-core format whose dense peak its GEMMs run at (a key of
    ``GPUSpec.dense_flops``); on a GPU without it the GEMMs are emulated at the BF16 peak, and
    ``precision.hardware_support`` names the GPUs that have it."""
    saved_input_bytes: float
    """Bytes per element Transformer Engine keeps of a quantized GEMM's input for the weight
    gradient, scales included (``factory.planner.memory``; ``docs/memory.md``)."""
    colour: str
    """Its colour in pictures (the layer stack's GEMM-format strip, the build page)."""
    options: str | None = None
    """The ``precision`` field holding its settings (``fp8`` ...), or None."""
    split_block: Callable[[Any], int] = _per_tensor
    """Elements that share a scale along a GEMM dimension: a tensor-parallel rank quantizes
    its share of a split dimension as one process does only if the share is whole blocks
    (``precision.tp_blocks``). 1 where the scale is per tensor (the amax is reduced over the
    group) or there is none."""
    quantizer: str | None = None
    """Import path of its ``factory.precision.quantizers.GemmQuantizer`` subclass (torch),
    built with ``for_recipe(options, seed)``; None for a recipe that quantizes nothing."""
    te_recipe: Callable[[Any, Any], Any] | None = None
    """(``transformer_engine.common.recipe``, its settings) -> the Transformer Engine recipe
    its linears run under; None where TE has none (the emulation runs it)."""
    megatron: Callable[[Any], MegatronPreset] | None = None
    """Its Megatron names for its settings; None where Megatron has none (the export refuses
    it as the default recipe and in per-module overrides)."""
    megatron_refusals: Callable[[Any], list[tuple[str, str]]] = _nothing_refused
    """The ``precision`` section (``PrecisionConfig``) -> (blueprint path, reason) for what
    Megatron cannot express of it when this is its default recipe."""
    emulated_because: Callable[[Any], str | None] = _no_gemm_wired
    """Its settings -> why factory's PyTorch runtime emulates its GEMMs on every GPU
    (dequantized operands, fp32 matmul), or None where they run on tensor cores
    (``torch._scaled_mm``) on a GPU that has its ``peak_format``. ``factory plan --precision``
    prints it and the run's kernel report (``GemmQuantizer.gemm_kernel``) gives it as the
    fallback reason."""
    checks: tuple[RecipeCheck, ...] = ()
    """Its own validate rules."""


def recipes_revision() -> int:
    """A number that changes whenever a recipe is registered or unregistered."""
    return _revision


def register_recipe(recipe: PrecisionRecipe) -> PrecisionRecipe:
    """Register ``recipe`` under its name (a name is registered once)."""
    global _revision
    existing = PRECISION_RECIPES.get(recipe.name)
    if existing is not None and existing is not recipe:
        raise ValueError(f"precision recipe {recipe.name!r} is already registered")
    PRECISION_RECIPES[recipe.name] = recipe
    _revision += 1
    return recipe


def unregister_recipe(name: str) -> None:
    global _revision
    if PRECISION_RECIPES.pop(name, None) is not None:
        _revision += 1


def recipe_named(name: str) -> PrecisionRecipe:
    try:
        return PRECISION_RECIPES[name]
    except KeyError:
        known = ", ".join(PRECISION_RECIPES)
        raise KeyError(f"no precision recipe is named {name!r} (registered: {known})") from None
