"""Every recipe the Megatron export writes for a preset: one for a blueprint without stages,
one per stage for a program, each with the blueprint and ``RecipeShape`` it was written from,
so the preset tests check every recipe either way."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import factory
from factory.exports.megatron import RecipeShape, export_megatron
from factory.exports.megatron_program import stage_recipe_shape
from factory.schemas import Blueprint
from factory.schemas.program import resolve_program

__all__ = ["ExportedRecipe", "export_preset"]


@dataclass(frozen=True)
class ExportedRecipe:
    label: str
    """The preset's name, or ``preset/stage`` for a program's stage."""
    blueprint: Blueprint
    """The blueprint the recipe trains (a stage's, for a program)."""
    folder: Path
    shape: RecipeShape

    @property
    def recipe(self) -> Path:
        return self.folder / "recipe.py"


def export_preset(name: str, out: Path) -> list[ExportedRecipe]:
    """Export preset ``name`` into ``out`` (allowing what Megatron cannot express)."""
    bp = factory.load_blueprint(name, [])
    export_megatron(bp, out, allow_unexpressed=True)
    program = resolve_program(bp)
    if not program.declared:
        return [ExportedRecipe(name, bp, out, RecipeShape.single(bp))]
    return [
        ExportedRecipe(
            f"{name}/{stage.name}",
            stage.blueprint,
            out / stage.name,
            stage_recipe_shape(bp, program, stage),
        )
        for stage in program
    ]
