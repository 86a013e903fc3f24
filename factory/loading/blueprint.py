"""A blueprint read and type-checked: a preset name or a YAML path in, a Blueprint out.

The cross-field rules run on top of this (``factory.checks.validate``).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from factory.errors import SourceMap
from factory.loading.compose import compose
from factory.loading.shipped import resolve_named_yaml, shipped_names
from factory.loading.validation_errors import validate_document
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
    return validate_document(Blueprint, data, source_map), source_map
