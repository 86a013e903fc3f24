"""Rules on the ``data`` section: the recipe it names must exist, and suit the objective."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from factory.checks.registry import Finding, rule
from factory.errors import BlueprintError, did_you_mean
from factory.loading.recipe import read_recipe, resolve_recipe
from factory.loading.shipped import shipped_names
from factory.schemas.blueprint import Blueprint


@rule("data.recipe_exists")
def recipe_exists(bp: Blueprint) -> Iterator[Finding]:
    """data.recipe names a shipped recipe (data_recipes/NAME.yaml) or an existing file."""
    name = bp.data.recipe
    path = Path(name)
    if path.suffix in (".yaml", ".yml") or len(path.parts) > 1:
        if not path.is_file():
            yield Finding("data.recipe", f"recipe file not found: {name!r}")
        return
    shipped = shipped_names("factory.data_recipes")
    if name not in shipped:
        yield Finding(
            "data.recipe",
            f"no shipped recipe named {name!r}{did_you_mean(name, shipped)}; "
            f"recipes: {', '.join(shipped)}",
        )


@rule("data.sft_loss_masks")
def sft_loss_masks(bp: Blueprint) -> Iterator[Finding]:
    """An sft objective trains on assistant turns: every source of its recipe masks prompts."""
    if bp.training.objective.kind != "sft":
        return
    try:
        recipe, _ = read_recipe(resolve_recipe(bp.data.recipe))
    except (BlueprintError, OSError):
        return  # a missing recipe is data.recipe_exists's; a broken one fails its own load
    unmasked = [src for src in recipe.sources if not src.steps[0].masks_prompts]
    if unmasked:
        named = ", ".join(f"{src.name} ({src.steps[0].kind})" for src in unmasked)
        yield Finding(
            "training.objective.kind",
            f"an sft objective trains only on the tokens a loss mask marks, but recipe "
            f"{recipe.name!r} has sources whose format step trains on every token: {named}; "
            "format them as chat, or give them to a pretraining stage",
        )
