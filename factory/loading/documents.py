"""What a YAML file is: a blueprint or a data recipe, told apart by its top-level keys.

The two share no top-level key (a blueprint has ``meta``, ``model``, ...; a
recipe has ``name``, ``sources``, ...), so the keys that match decide, and a
file whose keys are all misspelt is judged by the closest spellings. A file
that matches neither, or both equally, is an error rather than a guess: a
guess would report every key as unknown against the wrong schema.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any, Literal

from factory.errors import BlueprintError, Diagnostic
from factory.loading.yaml_source import display_path, read_yaml
from factory.schemas.blueprint import Blueprint
from factory.schemas.data_recipe import DataRecipe

__all__ = ["BLUEPRINT", "RECIPE", "Kind", "document_kind", "kind_of"]

Kind = Literal["blueprint", "data recipe"]
BLUEPRINT: Kind = "blueprint"
RECIPE: Kind = "data recipe"


_BLUEPRINT_ONLY = frozenset(
    ("extends", "meta", "model", "precision", "parallelism", "data", "training", "stages")
)
"""Blueprint's top-level keys (tests pin them to the schema's)."""


def _top_level_keys() -> dict[Kind, list[str]]:
    return {BLUEPRINT: ["extends", *Blueprint.model_fields], RECIPE: [*DataRecipe.model_fields]}


def _winner(scores: dict[Kind, int]) -> Kind | None:
    (first, a), (_, b) = sorted(scores.items(), key=lambda item: -item[1])
    return first if a > b else None


def kind_of(data: Any, file: str) -> Kind:
    """Blueprint or data recipe, from the parsed top level of ``file``."""
    if not isinstance(data, dict):
        message = "a blueprint or a data recipe must be a mapping of keys"
        raise BlueprintError([Diagnostic("", message, file, 1)])
    if data and all(k in _BLUEPRINT_ONLY for k in data):
        return BLUEPRINT  # the common case, decided without scoring
    keys = _top_level_keys()
    exact = {kind: sum(k in names for k in data) for kind, names in keys.items()}
    close = {
        kind: sum(bool(difflib.get_close_matches(str(k), names, n=1, cutoff=0.6)) for k in data)
        for kind, names in keys.items()
    }
    kind = _winner(exact) if any(exact.values()) else _winner(close)
    if kind is not None:
        return kind
    found = ", ".join(repr(str(k)) for k in list(data)[:5]) + (", ..." if len(data) > 5 else "")
    message = (
        f"not a blueprint (top-level keys: {', '.join(keys[BLUEPRINT])}) nor a data recipe "
        f"({', '.join(keys[RECIPE])}); found {found or 'no keys'}"
    )
    raise BlueprintError([Diagnostic("", message, file, 1)])


def document_kind(path: Path) -> Kind:
    """Read ``path`` and say what it is; unreadable files raise BlueprintError as usual."""
    file = display_path(path)
    data, _ = read_yaml(path, file)
    return kind_of(data, file)
