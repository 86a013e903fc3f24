"""``load_blueprint``: a preset name or a YAML path in, a validated Blueprint out.

Reading and type-checking are ``factory.loading``'s; this adds every cross-field rule,
some of which need the layer types and the planner, so it sits above them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from factory.checks.registry import RULES, Finding, Rule, run_rules
from factory.errors import BlueprintError, Diagnostic, SourceMap
from factory.loading.blueprint import read_blueprint, resolve_source
from factory.schemas.blueprint import Blueprint

__all__ = ["LoadedBlueprint", "load", "load_blueprint"]


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


def _run_rules(bp: Blueprint) -> list[tuple[Rule, Finding]]:
    """Every rule's findings, even when a rule cannot evaluate an already invalid blueprint.

    Some rules assume what others check: the memory planner sizes every layer
    type in the pattern, so it fails on a pattern using '-' without an ``mlp``
    section, which ``model.layer_sections`` reports. Such a failure is skipped
    when other rules found errors (those explain it); on a blueprint no rule
    faults it is a bug and propagates.
    """
    try:
        return run_rules(bp)
    except Exception as exc:
        failure = exc
    found: list[tuple[Rule, Finding]] = []
    for r in RULES.values():
        try:
            found += [(r, f) for f in r.check(bp)]
        except Exception:  # judged below, once every rule has run
            continue
    if not any(f.severity == "error" for _, f in found):
        raise failure
    return found


def load(name_or_path: str | Path, overrides: Sequence[str] = ()) -> LoadedBlueprint:
    """Compose, type-check and rule-check a blueprint; raise BlueprintError on any error."""
    source = resolve_source(name_or_path)
    bp, source_map = read_blueprint(source, overrides)
    diagnostics = [
        source_map.diagnostic(f.path, f.message, severity=f.severity, rule=r.name)
        for r, f in _run_rules(bp)
    ]
    if any(d.severity == "error" for d in diagnostics):
        raise BlueprintError(diagnostics)
    return LoadedBlueprint(bp, source, source_map, diagnostics)


def load_blueprint(name_or_path: str | Path, overrides: Sequence[str] = ()) -> Blueprint:
    """Load a preset name or a YAML path, with ``key=value`` overrides, into a Blueprint.

    Raises :class:`factory.BlueprintError` listing every problem found.
    """
    return load(name_or_path, overrides).blueprint
