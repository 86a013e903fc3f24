"""The presets' programs stage by stage, for the tests written about one stage or about what
validate says of every stage.

``stage_alone`` writes one stage of a preset as a single-stage blueprint file, as
``factory plan --stage NAME --search --out`` writes one. ``PUBLISHED_LAYOUT_WARNINGS`` is the
allow-list of the warnings that the presets' published layouts raise. Each entry says why
the warning is a fact of that layout. Any other warning on a preset is a failure.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import yaml

import factory
from factory.checks.registry import PROGRAM_RULES, run_rules
from factory.schemas.program import resolve_program

__all__ = [
    "PUBLISHED_LAYOUT_WARNINGS",
    "allowed_warnings",
    "published_warnings",
    "stage_alone",
    "stage_warnings",
]

CONTEXT_ACROSS_STAGES = "runtime.context_across_stages"

# (preset, stage) -> the rules that warn on that stage, and only there.
PUBLISHED_LAYOUT_WARNINGS: dict[tuple[str, str], frozenset[str]] = {
    # Nano's long-context extension runs CP=TP=EP=8 with PP=4 (arXiv:2512.20848, blueprints/
    # nano.yaml). factory's runtime does not run CP across pipeline stages (the Megatron
    # export does). The pattern is shared by every stage and pretraining runs without PP,
    # so it has no '|' marking where the 4 pipeline stages split, and the 52 layers split
    # evenly (the deprecated form of parallelism.pipeline).
    ("nano", "long_context"): frozenset({CONTEXT_ACROSS_STAGES, "parallelism.pipeline"}),
    # Ultra's long-context extension runs EP 128 (the Nemotron 3 Ultra tech report), which
    # spans more than GB200's 72-GPU NVLink domain, and CP 32 with PP 2, as Nano's does.
    ("ultra", "long_context"): frozenset({CONTEXT_ACROSS_STAGES, "parallelism.nvlink_domain"}),
    # Ultra's SFT layout is not published; blueprints/ultra.yaml reuses the long-context one.
    ("ultra", "sft"): frozenset({CONTEXT_ACROSS_STAGES, "parallelism.nvlink_domain"}),
}


def allowed_warnings(preset: str) -> dict[str, frozenset[str]]:
    """The allow-listed warning rules of ``preset``'s stages, by stage name."""
    return {
        stage: rules for (name, stage), rules in PUBLISHED_LAYOUT_WARNINGS.items() if name == preset
    }


def published_warnings() -> set[tuple[str, str, str]]:
    """The allow-list as (preset, stage, rule) triples."""
    return {(p, s, r) for (p, s), rules in PUBLISHED_LAYOUT_WARNINGS.items() for r in rules}


def stage_warnings(preset: str) -> dict[str, set[str]]:
    """The rules that warn on each stage of ``preset`` with any warning: every rule on the
    stage's blueprint and every program rule, as ``factory validate`` runs them."""
    program = resolve_program(factory.load_blueprint(preset))
    warned: dict[str, set[str]] = {}
    for stage in program:
        for rule, finding in run_rules(stage.blueprint):
            if finding.severity == "warning":
                warned.setdefault(stage.name, set()).add(rule.name)
    for program_rule in PROGRAM_RULES.values():
        for index, finding in program_rule.check(program):
            if finding.severity == "warning":
                warned.setdefault(program.stages[index].name, set()).add(program_rule.name)
    return warned


@functools.cache
def _stage_document(preset: str, stage: str) -> str:
    program = resolve_program(factory.load_blueprint(preset))
    document: dict[str, Any] = program.stage(stage).blueprint.model_dump(
        mode="json", exclude_unset=True
    )
    return yaml.safe_dump(document, sort_keys=False)


def stage_alone(preset: str, stage: str, folder: Path) -> Path:
    """Stage ``stage`` of ``preset`` as a single-stage blueprint, written into ``folder``:
    the base with the changes of every stage up to it, whole (no ``extends``)."""
    path = folder / f"{preset}_{stage}.yaml"
    path.write_text(_stage_document(preset, stage), encoding="utf-8")
    return path
