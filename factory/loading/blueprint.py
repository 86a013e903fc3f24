"""A blueprint read and type-checked: a preset name or a YAML path in, a Blueprint out.

The cross-field rules run on top of this (``factory.checks.validate``).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from factory.errors import BlueprintError, Diagnostic, SourceMap
from factory.loading.compose import compose
from factory.loading.shipped import resolve_named_yaml, shipped_names
from factory.loading.validation_errors import diagnostics_from_validation_error, validate_document
from factory.schemas.blueprint import Blueprint
from factory.schemas.program import StageInvalid, document_path, resolve_program

__all__ = ["preset_names", "read_blueprint", "resolve_source", "stage_diagnostics"]


def preset_names() -> list[str]:
    """Names of the shipped presets (``blueprints/*.yaml``)."""
    return shipped_names("factory.blueprints")


def resolve_source(name_or_path: str | Path) -> Path:
    """A preset name ('nano') or a path to a YAML file."""
    return resolve_named_yaml(name_or_path, "factory.blueprints", "preset")


def read_blueprint(source: Path, overrides: Sequence[str] = ()) -> tuple[Blueprint, SourceMap]:
    """Compose ``source`` with its fragments and ``overrides`` and type-check it and each of
    its stages; raise BlueprintError with ``file:line`` diagnostics on any error."""
    data, source_map = compose(source, overrides)
    blueprint = validate_document(Blueprint, data, source_map)
    try:
        resolve_program(blueprint)
    except StageInvalid as exc:
        raise BlueprintError(stage_diagnostics(exc, source_map)) from None
    return blueprint, source_map


def stage_diagnostics(exc: StageInvalid, source_map: SourceMap) -> list[Diagnostic]:
    """A stage's problems located in the blueprint file."""
    found = [source_map.diagnostic(path, message) for path, message in exc.problems]
    if exc.error is not None:
        set_paths = exc.set_paths
        found += diagnostics_from_validation_error(
            exc.error, Blueprint, source_map, lambda path: document_path(set_paths, path)
        )
    return found
