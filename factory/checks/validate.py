"""``load_blueprint``: a preset name or a YAML path in, a validated Blueprint out.

Reading and type-checking are ``factory.loading``'s; this adds every cross-field rule,
some of which need the layer types and the planner, so it sits above them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from factory.checks.registry import PROGRAM_RULES, RULES, Finding, Rule, run_rules
from factory.errors import BlueprintError, Diagnostic, SourceMap
from factory.loading.blueprint import read_blueprint, resolve_source
from factory.schemas.blueprint import Blueprint
from factory.schemas.program import Program, resolve_program

__all__ = ["LoadedBlueprint", "load", "load_blueprint", "program_diagnostics"]


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


def program_diagnostics(program: Program, source_map: SourceMap) -> list[Diagnostic]:
    """Every rule's findings on every stage's blueprint, then every program rule's, each once,
    located where the file writes the value it is about. A finding that not every stage has
    names its stages."""
    stages_of: dict[tuple[str, str, str, str], list[str]] = {}
    for stage in program:
        for r, f in _run_rules(stage.blueprint):
            key = (stage.document_path(f.path), f.message, f.severity, r.name)
            stages_of.setdefault(key, []).append(stage.name)
    for program_rule in PROGRAM_RULES.values():
        for index, f in program_rule.check(program):
            stage = program.stages[index]
            key = (stage.document_path(f.path), f.message, f.severity, program_rule.name)
            stages_of.setdefault(key, []).append(stage.name)
    out = []
    for (path, message, severity, rule_name), names in stages_of.items():
        if len(names) < len(program):
            label = "stage" if len(names) == 1 else "stages"
            message = f"{label} {', '.join(repr(n) for n in names)}: {message}"
        out.append(source_map.diagnostic(path, message, severity=severity, rule=rule_name))
    return out


def load(name_or_path: str | Path, overrides: Sequence[str] = ()) -> LoadedBlueprint:
    """Compose, type-check and rule-check a blueprint; raise BlueprintError on any error."""
    source = resolve_source(name_or_path)
    bp, source_map = read_blueprint(source, overrides)
    diagnostics = program_diagnostics(resolve_program(bp), source_map)
    if any(d.severity == "error" for d in diagnostics):
        raise BlueprintError(diagnostics)
    return LoadedBlueprint(bp, source, source_map, diagnostics)


def load_blueprint(name_or_path: str | Path, overrides: Sequence[str] = ()) -> Blueprint:
    """Load a preset name or a YAML path, with ``key=value`` overrides, into a Blueprint.

    Raises :class:`factory.BlueprintError` listing every problem found.
    """
    return load(name_or_path, overrides).blueprint
