"""The data.recipe rule."""

from __future__ import annotations

from blueprint_factory import assert_fires, findings, make


def test_shipped_recipe_names_pass() -> None:
    assert findings("data.recipe_exists", make()) == []


def test_unknown_recipe_name_suggests_one() -> None:
    assert_fires("data.recipe_exists", make(**{"data.recipe": "nanoo"}), "data.recipe", "'nano'")


def test_missing_recipe_file() -> None:
    bp = make(**{"data.recipe": "no/such/recipe.yaml"})
    assert_fires("data.recipe_exists", bp, "data.recipe", "not found")
