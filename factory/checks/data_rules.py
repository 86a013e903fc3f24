"""Rules on the ``data`` section and the recipe it names: the recipe exists and type-checks,
its tokenizer's ids fit the model's embedding, and an sft objective's sources mask their
prompts (what a stage trains on it in epochs is a program rule, ``program_rules``: a stage
may read on where the one before stopped).

The recipe is read once per file version (``recipe_of``), the tokenizer's size from its
``tokenizer.json`` as JSON (``factory.loading.recipe``): validate imports neither
``tokenizers`` nor torch, and reads nothing it has read before.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from factory.checks.registry import Finding, rule
from factory.errors import BlueprintError, SourceMap, did_you_mean
from factory.loading.recipe import (
    read_recipe,
    resolve_recipe,
    tokenizer_path,
    tokenizer_vocab_size,
)
from factory.loading.shipped import shipped_names
from factory.schemas.blueprint import Blueprint
from factory.schemas.data_recipe import DataRecipe

__all__ = ["RecipeRead", "recipe_of", "stated_tokens"]


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


@dataclass(frozen=True)
class RecipeRead:
    """A blueprint's recipe as read: the recipe, or why it does not type-check."""

    source: Path
    recipe: DataRecipe | None
    source_map: SourceMap | None
    problem: str = ""
    """The recipe's first diagnostic, ``file:line: path: message``, when it does not load."""


def recipe_of(bp: Blueprint) -> RecipeRead | None:
    """The recipe ``data.recipe`` names, read once per version of its file; None where there
    is no such file (``data.recipe_exists`` says so)."""
    try:
        source = resolve_recipe(bp.data.recipe)
        stat = source.stat()
    except (BlueprintError, OSError):
        return None
    return _read(str(source.resolve()), stat.st_mtime_ns, stat.st_size)


@lru_cache(maxsize=32)
def _read(source: str, _mtime_ns: int, _size: int) -> RecipeRead:
    try:
        recipe, source_map = read_recipe(Path(source))
    except BlueprintError as exc:
        first = exc.errors[0].format() if exc.errors else str(exc)
        return RecipeRead(Path(source), None, None, first)
    return RecipeRead(Path(source), recipe, source_map)


@rule("data.recipe_valid")
def recipe_valid(bp: Blueprint) -> Iterator[Finding]:
    """The recipe data.recipe names type-checks (factory data build would refuse it)."""
    read = recipe_of(bp)
    if read is not None and read.recipe is None:
        yield Finding("data.recipe", f"recipe {bp.data.recipe!r} does not load: {read.problem}")


@rule("data.tokenizer_vocab")
def tokenizer_fits_vocab(bp: Blueprint) -> Iterator[Finding]:
    """Every id the recipe's tokenizer produces has a row in the model's embedding."""
    read = recipe_of(bp)
    if read is None or read.recipe is None:
        return
    path = tokenizer_path(read.recipe, read.source)
    if not path.is_file():
        return  # the data build names the missing file (factory.data.loaded_recipe)
    try:
        ids = tokenizer_vocab_size(path)
    except (OSError, ValueError) as exc:
        yield Finding("data.recipe", f"recipe {bp.data.recipe!r}: cannot read {path}: {exc}")
        return
    if ids > bp.model.vocab_size:
        yield Finding(
            "model.vocab_size",
            f"vocab_size ({bp.model.vocab_size:,}) is smaller than the {ids:,} ids of the "
            f"tokenizer of recipe {bp.data.recipe!r} ({path}): a token id past the embedding "
            f"fails the first step; set model.vocab_size to at least {ids:,}",
        )


@rule("data.sft_loss_masks")
def sft_loss_masks(bp: Blueprint) -> Iterator[Finding]:
    """An sft objective trains on assistant turns: every source of its recipe masks prompts."""
    if bp.training.objective.kind != "sft":
        return
    read = recipe_of(bp)
    if read is None or read.recipe is None:
        return  # data.recipe_exists or data.recipe_valid says why
    recipe = read.recipe
    unmasked = [src for src in recipe.sources if not src.steps[0].masks_prompts]
    if unmasked:
        named = ", ".join(f"{src.name} ({src.steps[0].kind})" for src in unmasked)
        yield Finding(
            "training.objective.kind",
            f"an sft objective trains only on the tokens a loss mask marks, but recipe "
            f"{recipe.name!r} has sources whose format step trains on every token: {named}; "
            "format them as chat, or give them to a pretraining stage",
        )


def stated_tokens(recipe: DataRecipe) -> int | None:
    """Tokens of the curated mixture as the recipe states them: ``total_tokens`` for the
    weighted sources plus every source's own ``tokens``; None where a source's share is
    only known once curated (weighted sources without ``total_tokens``, or in ``epochs``)."""
    weighted = [s for s in recipe.sources if s.weight is not None]
    if weighted and recipe.total_tokens is None:
        return None
    if any(s.weight is None and s.tokens is None for s in recipe.sources):
        return None
    budgets = sum(s.tokens for s in recipe.sources if s.tokens is not None)
    if weighted and recipe.total_tokens is not None:
        budgets += recipe.total_tokens
    return budgets
