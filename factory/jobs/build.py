"""``factory.build``: the whole factory for one blueprint, stage by stage, into one folder.

Stages (``factory.jobs.build_stages``), each with a one-line result::

    validate     resolved.yaml (blueprint and data recipe checked)
    plan         plan.json, report.md (parameters, FLOPs, memory, cost, failures)
    model        model_check.json (full model on the meta device vs spec and plan)
    precision    precision.json (every GEMM's format)
    export       exports/hf/config.json, exports/megatron/
    data         data/ (curated, Energon-loadable shards at data.seq_len)
    smoke        smoke/ (the proxy trained a few dozen steps; the loss must fall)
    distributed  distributed/, distributed.json (2 ranks vs the smoke run)
    report       report.html (one self-contained page of all of it)

A program (a blueprint with ``stages``) is built per program stage where it matters
(``factory.jobs.build_program``): the plan stage adds ``program_plan.json``, the data
stage curates each program stage's recipe into ``data/<stage>/``, the smoke run trains
the proxy through every program stage (:func:`factory.train` on the program, into
``smoke/<stage>/``), and the page draws the program on one timeline.

``build.json`` records every stage's status, time and result (and, for a program, each
program stage's under ``program``), rewritten atomically after each stage. A rerun
reuses the stages recorded done (their files are whole), redoes the rest, and starts
over when the blueprint or the step counts changed. The data build and the smoke run resume from their own
checkpoints.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from factory.io import atomic_write_text, folder_bytes
from factory.jobs.build_defaults import (
    DEFAULT_CHECK_STEPS,
    DEFAULT_SMOKE_STEPS,
    DEFAULT_STAGE_SMOKE_STEPS,
)
from factory.jobs.build_stages import BuildContext, StageFailed, run_stage
from factory.progress import Progress, silent
from factory.report.build_folder import BUILD_RECORD, OUTPUTS, PROGRAM_OUTPUTS, STAGES, outputs
from factory.schemas.program import resolve_program

if TYPE_CHECKING:
    from factory.schemas.blueprint import Blueprint

__all__ = [
    "DEFAULT_CHECK_STEPS",
    "DEFAULT_SMOKE_STEPS",
    "DEFAULT_STAGE_SMOKE_STEPS",
    "STAGES",
    "BuildFailed",
    "BuildResult",
    "StageRecord",
    "build",
]


class BuildFailed(RuntimeError):
    """A stage failed; ``stage`` names it and ``build.json`` records it."""

    def __init__(self, stage: str, message: str) -> None:
        super().__init__(f"{stage}: {message}")
        self.stage = stage


@dataclass(frozen=True)
class StageRecord:
    stage: str
    status: str
    """``done``, ``reused`` (done by an earlier run), ``skipped`` or ``failed``."""
    seconds: float
    result: str
    program: dict[str, Any] | None = None
    """Per program stage (a blueprint with ``stages``), what this build stage did with it."""

    def to_dict(self) -> dict[str, Any]:
        """As build.json records it (a single-stage build's records have no ``program``)."""
        record = asdict(self)
        if self.program is None:
            del record["program"]
        return record


@dataclass(frozen=True)
class BuildResult:
    out: Path
    stages: list[StageRecord]
    size: int
    """Bytes of the build folder when the build ended."""


def _fingerprint(bp: Blueprint, steps: int, check_steps: int) -> str:
    """What every stage's output depends on: the resolved blueprint and the step counts."""
    text = json.dumps([bp.model_dump(mode="json"), steps, check_steps], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def _read_record(out: Path, fingerprint: str) -> dict[str, Any]:
    """The stages an earlier run of this very build finished; nothing if it built another."""
    path = out / BUILD_RECORD
    if path.is_file():
        record = json.loads(path.read_text(encoding="utf-8"))
        if record.get("fingerprint") == fingerprint:
            return record["stages"]
        for files in (*OUTPUTS.values(), *PROGRAM_OUTPUTS.values()):  # not ours to reuse
            for name in files:
                target = out / name
                if target.is_dir():
                    shutil.rmtree(target)
                elif target.exists():
                    target.unlink()
    return {}


def _write_record(out: Path, name: str, fingerprint: str, stages: dict[str, Any]) -> None:
    document = {"name": name, "fingerprint": fingerprint, "stages": stages}
    atomic_write_text(out / BUILD_RECORD, json.dumps(document, indent=2) + "\n")


def _reusable(out: Path, stage: str, earlier: dict[str, Any], program: bool) -> bool:
    done = earlier.get(stage, {}).get("status") in ("done", "reused")
    return done and all((out / name).exists() for name in outputs(stage, program))


def build(
    blueprint: Blueprint,
    *,
    out: Path | None = None,
    source: str | Path | None = None,
    steps: int | None = None,
    check_steps: int = DEFAULT_CHECK_STEPS,
    skip: Iterable[str] = (),
    workers: int = 1,
    progress: Progress | None = None,
    on_stage: Callable[[StageRecord], None] | None = None,
) -> BuildResult:
    """Run every stage of the factory for ``blueprint`` into ``out`` (default ``build/NAME``).

    ``blueprint`` is validated already (:func:`factory.load_blueprint`); ``source``
    is named in resolved.yaml. ``steps`` are the smoke run's (default
    :data:`DEFAULT_SMOKE_STEPS`; for a program, per program stage, default
    :data:`DEFAULT_STAGE_SMOKE_STEPS`), ``check_steps`` the distributed check's (its first
    steps, at most ``steps``). ``skip`` names
    stages not to run (the distributed check needs the smoke run). ``progress``
    gets the long stages' inner progress, ``on_stage`` each stage's record as it
    ends. Raises :class:`BuildFailed` when a stage fails, after recording it.
    """
    program = resolve_program(blueprint)  # the loaded blueprint's stages resolve already
    if steps is None:
        steps = DEFAULT_STAGE_SMOKE_STEPS if program.declared else DEFAULT_SMOKE_STEPS
    skipped = set(skip)
    unknown = skipped - set(STAGES)
    if unknown:
        raise ValueError(f"unknown stages {sorted(unknown)}; stages are {', '.join(STAGES)}")
    if "smoke" in skipped and "distributed" not in skipped:
        raise ValueError("the distributed check compares with the smoke run: skip both or neither")
    if "smoke" in skipped:  # the evaluate stage reads nothing else: it goes with it
        skipped.add("evaluate")
    if steps < 2 or not 1 <= check_steps <= steps:
        raise ValueError(
            f"need steps >= 2 and 1 <= check_steps <= steps, got {steps}, {check_steps}"
        )
    destination = (out or Path("build") / blueprint.meta.name).resolve()
    destination.mkdir(parents=True, exist_ok=True)
    fingerprint = _fingerprint(blueprint, steps, check_steps)
    earlier = _read_record(destination, fingerprint)
    context = BuildContext(
        blueprint, program, source, destination, steps, check_steps, workers, progress or silent
    )
    records: dict[str, Any] = {}
    done: list[StageRecord] = []
    for stage in STAGES:
        record = _stage(stage, context, earlier, skipped)
        records[stage] = record.to_dict()
        _write_record(destination, blueprint.meta.name, fingerprint, records)
        done.append(record)
        if on_stage is not None:
            on_stage(record)
        if record.status == "failed":
            raise BuildFailed(stage, record.result)
    return BuildResult(destination, done, folder_bytes(destination))


def _stage(
    stage: str, context: BuildContext, earlier: dict[str, Any], skipped: set[str]
) -> StageRecord:
    if stage in skipped:
        implied = stage == "evaluate" and "smoke" in skipped
        why = "skipped (it evaluates the smoke run, skipped)" if implied else "skipped (--skip)"
        return StageRecord(stage, "skipped", 0.0, why)
    if _reusable(context.out, stage, earlier, context.program.declared) and stage != "report":
        before = earlier[stage]
        return StageRecord(
            stage, "reused", before["seconds"], before["result"], before.get("program")
        )
    start = time.perf_counter()
    try:
        outcome, status = run_stage(stage, context), "done"
    except StageFailed as exc:
        outcome, status = exc.outcome, "failed"
    seconds = round(time.perf_counter() - start, 2)
    return StageRecord(stage, status, seconds, outcome.result, outcome.program)
