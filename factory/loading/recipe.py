"""A data recipe read and type-checked: a shipped recipe's name or a YAML path in, a
DataRecipe out.

The blueprint's reader (``yaml_source.read_yaml``: lines, bounds, no tags or
duplicate keys) and validation (``validation_errors.validate_document``:
``file:line: path: message`` diagnostics, did-you-mean) serve recipes too. A
recipe has no ``extends`` and no ``--set`` (it repeats values with YAML anchors
and aliases); whether its input files exist is ``factory.data``'s to say (it
knows what a source path may be).
"""

from __future__ import annotations

from pathlib import Path

from factory.errors import BlueprintError, Diagnostic, SourceMap
from factory.loading.shipped import resolve_named_yaml, shipped_names
from factory.loading.validation_errors import validate_document
from factory.loading.yaml_source import MERGE_KEYS_IN_A_RECIPE, display_path, read_yaml
from factory.schemas.data_recipe import DataRecipe

__all__ = ["read_recipe", "recipe_names", "resolve_recipe"]


def recipe_names() -> list[str]:
    """Names of the shipped recipes (``data_recipes/*.yaml``)."""
    return shipped_names("factory.data_recipes")


def resolve_recipe(name_or_path: str | Path) -> Path:
    """A shipped recipe's name ('nano') or a path to a YAML file."""
    return resolve_named_yaml(name_or_path, "factory.data_recipes", "recipe")


def read_recipe(source: Path) -> tuple[DataRecipe, SourceMap]:
    """Read ``source`` and type-check it; raise BlueprintError with ``file:line``
    diagnostics on any error."""
    shown = display_path(source)
    data, source_map = read_yaml(source, shown, MERGE_KEYS_IN_A_RECIPE)
    if not isinstance(data, dict):
        raise BlueprintError([Diagnostic("", "a recipe must be a mapping", shown, 1)])
    return validate_document(DataRecipe, data, source_map), source_map
