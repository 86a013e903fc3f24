"""A data recipe loaded for a build: the typed recipe, where it lives, and its inputs checked.

Reading and type-checking the YAML is ``factory.loading.recipe``'s (the same
reader and ``file:line: path: message`` diagnostics as blueprints); here every
source path must name readable inputs and every benchmark and tokenizer file
must exist, and a chat template must read, compile and keep its renders
prefixes of each other (``factory.data.steps.chat_template.check_template``),
so a build fails before any work starts.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from factory.data.steps.chat_template import (
    ChatTemplate,
    ChatTemplateError,
    check_template,
    read_template_file,
)
from factory.data.steps.source_files import expand_source_paths
from factory.dotted_paths import join_path
from factory.errors import BlueprintError, Diagnostic, SourceMap
from factory.loading.recipe import read_recipe, resolve_recipe
from factory.schemas.data_recipe import DataRecipe, PackingConfig

__all__ = ["LoadedRecipe", "load_recipe", "recipe_hash", "with_seq_len"]


@dataclass(frozen=True)
class LoadedRecipe:
    """A validated recipe, the file it was read from (resolved), the line of each value, and
    its chat template read (None: the built-in format)."""

    recipe: DataRecipe
    source: Path
    source_map: SourceMap
    chat_template: ChatTemplate | None = None

    def resolve(self, relative: str) -> Path:
        """A path from the recipe, relative to the recipe file."""
        path = Path(relative)
        return path if path.is_absolute() else (self.source.parent / path)


def load_recipe(name_or_path: str | Path) -> LoadedRecipe:
    """Parse and validate; missing inputs fail here, before any work starts."""
    source = resolve_recipe(name_or_path).resolve()
    recipe, source_map = read_recipe(source)
    loaded = LoadedRecipe(recipe, source, source_map)
    problems = _missing_inputs(loaded)
    template, template_problems = _chat_template(loaded)
    problems += template_problems
    if problems:
        raise BlueprintError(problems)
    return LoadedRecipe(recipe, source, source_map, template)


def _chat_template(loaded: LoadedRecipe) -> tuple[ChatTemplate | None, list[Diagnostic]]:
    """The recipe's chat template, read and checked, or what is wrong with it."""
    config, source_map = loaded.recipe.tokenizer, loaded.source_map
    if config.chat_template is not None:
        where = "tokenizer.chat_template"
        template = ChatTemplate(config.chat_template, where)
    elif config.chat_template_file is not None:
        where = "tokenizer.chat_template_file"
        path = loaded.resolve(config.chat_template_file)
        if not path.is_file():
            return None, [source_map.diagnostic(where, "chat template file not found")]
        try:
            template = read_template_file(path)
        except ChatTemplateError as exc:
            return None, [source_map.diagnostic(where, str(exc))]
    else:
        return None, []
    try:
        check_template(template)
    except ChatTemplateError as exc:
        return None, [source_map.diagnostic(where, f"chat template: {exc}")]
    return template, []


def _missing_inputs(loaded: LoadedRecipe) -> list[Diagnostic]:
    recipe, source_map = loaded.recipe, loaded.source_map
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
    return problems


def recipe_hash(loaded: LoadedRecipe) -> str:
    """sha256 of the validated recipe (and of its chat template's text, which a file may
    hold): what the manifest records, the same on every machine."""
    canonical = json.dumps(loaded.recipe.model_dump(mode="json"), sort_keys=True)
    template = loaded.chat_template
    if template is not None:
        canonical += json.dumps([template.text, template.special_tokens])
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
    return LoadedRecipe(recipe, loaded.source, loaded.source_map, loaded.chat_template)
