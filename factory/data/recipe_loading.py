"""Load and validate a data recipe with the same ``file:line: path: message`` errors as blueprints."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from factory.errors import BlueprintError, Diagnostic, SourceMap
from factory.loading.paths import join_path
from factory.loading.shipped import resolve_named_yaml, shipped_names
from factory.loading.validation_errors import diagnostics_from_validation_error
from factory.loading.yaml_source import read_yaml
from factory.schemas.data_recipe import DataRecipe

__all__ = ["LoadedRecipe", "load_recipe", "recipe_names", "resolve_recipe", "with_seq_len"]


def recipe_names() -> list[str]:
    return shipped_names("factory.data_recipes")


def resolve_recipe(name_or_path: str | Path) -> Path:
    return resolve_named_yaml(name_or_path, "factory.data_recipes", "recipe")


@dataclass(frozen=True)
class LoadedRecipe:
    recipe: DataRecipe
    source: Path
    source_map: SourceMap

    def resolve(self, relative: str) -> Path:
        """A path from the recipe, relative to the recipe file."""
        path = Path(relative)
        return path if path.is_absolute() else (self.source.parent / path)


def load_recipe(name_or_path: str | Path) -> LoadedRecipe:
    """Parse and validate; missing inputs fail here, before any work starts."""
    from factory.data.readers import expand_source_paths

    source = resolve_recipe(name_or_path).resolve()
    try:
        shown = str(source.relative_to(Path.cwd().resolve()))
    except ValueError:
        shown = str(source)
    data, source_map = read_yaml(source, shown)
    if not isinstance(data, dict):
        raise BlueprintError([Diagnostic("", "a recipe must be a mapping", shown, 1)])
    try:
        recipe = DataRecipe.model_validate(data)
    except ValidationError as exc:
        raise BlueprintError(
            diagnostics_from_validation_error(exc, DataRecipe, source_map)
        ) from None
    loaded = LoadedRecipe(recipe, source, source_map)
    problems = []
    for index, src in enumerate(recipe.sources):
        if not expand_source_paths(loaded.resolve(src.path)):
            where = join_path(join_path("sources", index), "path")
            problems.append(source_map.diagnostic(where, f"no input files at {src.path!r}"))
    for index, bench in enumerate(recipe.decontam.benchmarks):
        if not loaded.resolve(bench).is_file():
            where = join_path("decontam.benchmarks", index)
            problems.append(source_map.diagnostic(where, f"benchmark file not found: {bench!r}"))
    if recipe.tokenizer.path and not loaded.resolve(recipe.tokenizer.path).is_file():
        problems.append(source_map.diagnostic("tokenizer.path", "tokenizer file not found"))
    if problems:
        raise BlueprintError(problems)
    return loaded


def with_seq_len(loaded: LoadedRecipe, seq_len: int) -> LoadedRecipe:
    """The same recipe packed to ``seq_len``: a blueprint's data section decides it."""
    packing = loaded.recipe.packing.model_copy(update={"seq_len": seq_len})
    recipe = loaded.recipe.model_copy(update={"packing": packing})
    return LoadedRecipe(recipe, loaded.source, loaded.source_map)
