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

import json
from functools import lru_cache
from pathlib import Path

import factory.data_recipes
from factory.errors import BlueprintError, Diagnostic, SourceMap
from factory.loading.shipped import resolve_named_yaml, shipped_names
from factory.loading.validation_errors import validate_document
from factory.loading.yaml_source import MERGE_KEYS_IN_A_RECIPE, display_path, read_yaml
from factory.schemas.data_recipe import DataRecipe

__all__ = [
    "DEFAULT_TOKENIZER",
    "read_recipe",
    "recipe_names",
    "resolve_recipe",
    "tokenizer_path",
    "tokenizer_vocab_size",
]

DEFAULT_TOKENIZER = Path(factory.data_recipes.__file__).parent / "tokenizer" / "tokenizer.json"
"""The tokenizer a recipe without ``tokenizer.path`` tokenizes with."""


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


def tokenizer_path(recipe: DataRecipe, source: Path) -> Path:
    """The tokenizer.json ``recipe`` (read from ``source``) tokenizes with."""
    if recipe.tokenizer.path is None:
        return DEFAULT_TOKENIZER
    path = Path(recipe.tokenizer.path)
    return path if path.is_absolute() else source.parent / path


def tokenizer_vocab_size(path: Path) -> int:
    """The ids a ``tokenizer.json`` can produce (its largest id + 1, added tokens included),
    read as JSON: no ``tokenizers``, no torch. OSError or ValueError on a file that is not
    one."""
    stat = path.stat()
    return _vocab_size(str(path.resolve()), stat.st_mtime_ns, stat.st_size)


@lru_cache(maxsize=16)
def _vocab_size(path: str, _mtime_ns: int, _size: int) -> int:
    with open(path, encoding="utf-8") as file:
        document = json.load(file)
    try:
        vocab = document["model"]["vocab"]
        # BPE, WordPiece and WordLevel map tokens to ids; Unigram lists [piece, score] by id.
        ids = list(vocab.values()) if isinstance(vocab, dict) else [len(vocab) - 1]
        ids += [token["id"] for token in document.get("added_tokens", [])]
        return int(max(ids, default=-1)) + 1
    except (KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"{path} is not a tokenizer.json: {exc!r}") from None
