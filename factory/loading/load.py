"""``load_blueprint``: a preset name or a YAML path in, a validated Blueprint out."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import ValidationError

from factory.errors import BlueprintError, Diagnostic, SourceMap, did_you_mean
from factory.loading.compose import compose
from factory.loading.validation_errors import diagnostics_from_validation_error
from factory.schemas.blueprint import Blueprint

__all__ = ["LoadedBlueprint", "load", "load_blueprint", "preset_names", "resolve_source"]


def _preset_dir() -> Path:
    import factory.blueprints

    return Path(factory.blueprints.__file__).parent


def preset_names() -> list[str]:
    """Names of the shipped presets (``blueprints/*.yaml``)."""
    return sorted(p.stem for p in _preset_dir().glob("*.yaml"))


def resolve_source(name_or_path: str | Path) -> Path:
    """A preset name ('nano') or a path to a YAML file."""
    candidate = Path(name_or_path)
    # A bare name is a preset unless a file of that name exists here; a folder that
    # happens to share the name (say build output in ./ultra) does not shadow it.
    if candidate.suffix in (".yaml", ".yml") or candidate.is_file() or len(candidate.parts) > 1:
        return candidate
    preset = _preset_dir() / f"{name_or_path}.yaml"
    if preset.is_file():
        return preset
    hint = did_you_mean(str(name_or_path), preset_names())
    raise BlueprintError(
        [
            Diagnostic(
                "",
                f"no preset or file named {str(name_or_path)!r}{hint}; "
                f"presets: {', '.join(preset_names())}",
                str(name_or_path),
                0,
            )
        ]
    )


@dataclass(frozen=True)
class LoadedBlueprint:
    """A validated blueprint with where it came from and the warnings it raised."""

    blueprint: Blueprint
    source: Path
    source_map: SourceMap
    diagnostics: list[Diagnostic] = field(default_factory=list)

    @property
    def warnings(self) -> list[Diagnostic]:
        return [d for d in self.diagnostics if d.severity == "warning"]


def load(name_or_path: str | Path, overrides: Sequence[str] = ()) -> LoadedBlueprint:
    """Compose, type-check and rule-check a blueprint; raise BlueprintError on any error."""
    from factory.checks.registry import run_rules

    source = resolve_source(name_or_path)
    data, source_map = compose(source, overrides)
    try:
        bp = Blueprint.model_validate(data)
    except ValidationError as exc:
        raise BlueprintError(
            diagnostics_from_validation_error(exc, Blueprint, source_map)
        ) from None
    diagnostics = [
        source_map.diagnostic(f.path, f.message, severity=f.severity, rule=r.name)
        for r, f in run_rules(bp)
    ]
    if any(d.severity == "error" for d in diagnostics):
        raise BlueprintError(diagnostics)
    return LoadedBlueprint(bp, source, source_map, diagnostics)


def load_blueprint(name_or_path: str | Path, overrides: Sequence[str] = ()) -> Blueprint:
    """Load a preset name or a YAML path, with ``key=value`` overrides, into a Blueprint.

    Raises :class:`factory.BlueprintError` listing every problem found.
    """
    return load(name_or_path, overrides).blueprint
