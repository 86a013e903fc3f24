"""Precision recipes, one module each (``registry.py`` says what a recipe declares).

:data:`SHIPPED` is the one registry entry per recipe: its order is the order the JSON
Schema and pictures list the recipes in.
"""

from __future__ import annotations

from factory.schemas.precision_recipes.bf16 import BF16
from factory.schemas.precision_recipes.fp8 import FP8
from factory.schemas.precision_recipes.mor import MOR
from factory.schemas.precision_recipes.mxfp8 import MXFP8
from factory.schemas.precision_recipes.nvfp4 import NVFP4
from factory.schemas.precision_recipes.registry import (
    PRECISION_RECIPES,
    MegatronPreset,
    PrecisionRecipe,
    RecipeCheck,
    RecipeFinding,
    recipe_named,
    recipes_revision,
    register_recipe,
    unregister_recipe,
)

__all__ = [
    "HIGH_PRECISION",
    "PRECISION_RECIPES",
    "SHIPPED",
    "MegatronPreset",
    "PrecisionRecipe",
    "RecipeCheck",
    "RecipeFinding",
    "recipe_named",
    "recipes_revision",
    "register_recipe",
    "unregister_recipe",
]

SHIPPED: tuple[PrecisionRecipe, ...] = (BF16, FP8, NVFP4, MXFP8, MOR)
"""The recipes factory ships."""

HIGH_PRECISION = BF16.name
"""The recipe ``precision.high_precision`` layers keep whatever the others say."""

for _recipe in SHIPPED:
    register_recipe(_recipe)
