"""Load and validate a data recipe with the same ``file:line: path: message`` errors as blueprints."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import typing
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ValidationError

from factory.data.steps.source_files import expand_source_paths
from factory.dotted_paths import join_path
from factory.errors import BlueprintError, Diagnostic, SourceMap, did_you_mean
from factory.loading.shipped import resolve_named_yaml, shipped_names
from factory.loading.validation_errors import diagnostics_from_validation_error
from factory.loading.yaml_source import read_yaml
from factory.schemas.data_recipe import DataRecipe, PackingConfig, Step

__all__ = [
    "LoadedRecipe",
    "load_recipe",
    "recipe_hash",
    "recipe_names",
    "resolve_recipe",
    "with_seq_len",
]


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
        raise BlueprintError(_diagnostics(exc, source_map)) from None
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


def recipe_hash(loaded: LoadedRecipe) -> str:
    """sha256 of the validated recipe: what the manifest records, the same on every machine."""
    canonical = json.dumps(loaded.recipe.model_dump(mode="json"), sort_keys=True)
    return hashlib.sha256(canonical.encode()).hexdigest()


def with_seq_len(loaded: LoadedRecipe, seq_len: int) -> LoadedRecipe:
    """The same recipe packed to ``seq_len``: a blueprint's data section decides it.

    The new length is validated as if the recipe had said it (``ValueError``
    beyond ``packing.seq_len``'s bounds).
    """
    try:
        packing = PackingConfig.model_validate(
            {**loaded.recipe.packing.model_dump(), "seq_len": seq_len}
        )
    except ValidationError as exc:
        reason = exc.errors()[0]["msg"]
        raise ValueError(
            f"cannot pack recipe {loaded.recipe.name!r} to {seq_len}: {reason}"
        ) from None
    recipe = loaded.recipe.model_copy(update={"packing": packing})
    return LoadedRecipe(recipe, loaded.source, loaded.source_map)


def _step_types() -> dict[str, type[BaseModel]]:
    """Step sections by their ``kind`` tag (the members of the ``Step`` union)."""
    union = typing.get_args(Step)[0]  # Annotated[union, discriminator]
    return {cls.model_fields["kind"].default: cls for cls in typing.get_args(union)}


def _diagnostics(exc: ValidationError, source_map: SourceMap) -> list[Diagnostic]:
    """``file:line: path: message`` per error, with step paths as the YAML writes them.

    pydantic puts a discriminated union's tag in an error's location
    (``sources[0].steps[1].heuristics.min_words``); the recipe has no such key,
    so the tag is removed, which also finds the line of the value itself.
    Unknown keys in a step get a did-you-mean from that step's own fields.
    """
    steps = _step_types()
    errors = exc.errors()
    untagged = [{**e, "loc": _untag(e["loc"], steps)[0]} for e in errors]
    plain = ValidationError.from_exception_data(exc.title, untagged)  # type: ignore[arg-type]
    diagnostics = diagnostics_from_validation_error(plain, DataRecipe, source_map)
    for index, error in enumerate(errors):
        step = _untag(error["loc"], steps)[1]
        if error["type"] == "extra_forbidden" and step is not None:
            hint = did_you_mean(str(error["loc"][-1]), step.model_fields)
            diagnostics[index] = dataclasses.replace(
                diagnostics[index], message="unknown key" + hint
            )
    return diagnostics


def _untag(
    loc: Sequence[str | int], steps: dict[str, type[BaseModel]]
) -> tuple[tuple[str | int, ...], type[BaseModel] | None]:
    """``loc`` without the step tag that follows ``steps, <index>``, and that step's type."""
    for i in range(2, len(loc)):
        if loc[i - 2] == "steps" and isinstance(loc[i - 1], int) and loc[i] in steps:
            return (*loc[:i], *loc[i + 1 :]), steps[str(loc[i])]
    return tuple(loc), None
