"""Rules on the ``data`` section: the recipe it names must exist."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from factory.checks.registry import Finding, rule
from factory.errors import did_you_mean
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
