"""A blueprint read and type-checked: a preset name or a YAML path in, a Blueprint out.

The cross-field rules run on top of this (``factory.checks.validate``).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from pydantic import ValidationError

from factory.errors import BlueprintError, SourceMap
from factory.loading.compose import compose
from factory.loading.shipped import resolve_named_yaml, shipped_names
from factory.loading.validation_errors import diagnostics_from_validation_error
from factory.schemas.blueprint import Blueprint

__all__ = ["preset_names", "read_blueprint", "resolve_source"]


def preset_names() -> list[str]:
    """Names of the shipped presets (``blueprints/*.yaml``)."""
    return shipped_names("factory.blueprints")


def resolve_source(name_or_path: str | Path) -> Path:
    """A preset name ('nano') or a path to a YAML file."""
    return resolve_named_yaml(name_or_path, "factory.blueprints", "preset")


def read_blueprint(source: Path, overrides: Sequence[str] = ()) -> tuple[Blueprint, SourceMap]:
    """Compose ``source`` with its fragments and ``overrides`` and type-check it; raise
    BlueprintError with ``file:line`` diagnostics on any error."""
    data, source_map = compose(source, overrides)
    try:
        bp = Blueprint.model_validate(data)
    except ValidationError as exc:
        raise BlueprintError(
            diagnostics_from_validation_error(exc, Blueprint, source_map)
        ) from None
    return bp, source_map
