"""A blueprint with ``stages`` trained as one program: one run folder, stage after stage.

The program's run folder (``runs/NAME`` or ``out``) holds:

* ``program.json``: the stages in order, each with its ``status`` (``pending``,
  ``running``, ``completed``, or how it ended early: ``interrupted``, ``stopped``,
  ``diverged``), its ``steps`` and, once complete, its ``boundary``: the step and path of
  its final checkpoint, which the next stage starts from. Rewritten whole (atomically) by
  rank 0 as each stage starts and ends;
* ``<stage>/``: an ordinary run folder per stage (``factory.jobs.train``): its
  ``checkpoints/``, ``metrics.jsonl`` (every record names the stage), ``train.json``,
  ``model/`` and ``report/``, and ``data/`` unless ``data`` is given (then
  ``data/<stage>/`` is that stage's shards).

A stage's final checkpoint is its boundary: the stage writes none after it, so the keep
policy never prunes it. The next stage loads its weights (DCP, onto the stage's own
layout), its optimizer state when ``carry.optimizer`` and its data position when
``carry.data_position`` (that stage then reads its predecessor's shards: the program
checks they are the same recipe at the same length), and follows its learning-rate
window (``ProgramStage.schedule_offset`` / ``schedule_steps``). Model initialisation
counts only in the first stage; later stages overwrite theirs with the boundary's.

A rerun resumes where the program stopped: a complete stage is found complete and skipped,
the interrupted stage resumes from its newest checkpoint or, having written none, from
the previous boundary, so a kill anywhere (mid-stage or between stages) and a rerun end
bit for bit as an uninterrupted run. ``stage`` trains one stage alone, refused while its
predecessor has no boundary. ``steps`` is the steps of each stage; with ``proxy`` every
stage trains the same proxy model (``factory.proxy.derive_program_proxy``).

Torch-free; :func:`run_program` imports the rank's share of the work when it runs.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from factory.errors import did_you_mean
from factory.io import atomic_write_text
from factory.jobs.train_errors import CannotResume, TrainRefused
from factory.jobs.train_request import StageRun, TrainRequest, TrainResult, TrainSettings
from factory.proxy import derive_program_proxy
from factory.proxy_layout import derive_proxy_layout
from factory.runtime.history import RunHistory, StepRecord
from factory.schemas.blueprint import Blueprint
from factory.schemas.program import Program, ProgramStage, resolve_program

__all__ = [
    "PROGRAM_FILE",
    "PlannedStage",
    "ProgramRequest",
    "ProgramResult",
    "StageRefused",
    "boundary_checkpoint",
    "plan_stages",
    "run_program",
]

PROGRAM_FILE = "program.json"


class StageRefused(TrainRefused):
    """``stage`` names no stage of the program, or one that cannot start yet."""


@dataclasses.dataclass(frozen=True)
class PlannedStage:
    """A stage about to be checked into a :class:`TrainRequest`: the blueprint it trains
    (its proxy's, laid out, with ``proxy``), the layout's changes, its settings and place."""

    blueprint: Blueprint
    changes: list[str]
    settings: TrainSettings
    stage: StageRun
    source: ProgramStage
    """The stage as the program declares it (``document_path`` places its findings)."""


@dataclasses.dataclass(frozen=True)
class ProgramRequest:
    """A program ``prepare_program`` accepted: the stages this call trains, in order."""

    blueprint: Blueprint
    """The program's blueprint, as written."""
    out: Path
    """The program's run folder (absolute)."""
    names: tuple[str, ...]
    """Every stage of the program, in order."""
    steps: tuple[int, ...]
    """Every stage's steps (what this call trains them to)."""
    stages: tuple[TrainRequest, ...]
    """The stages to train: all (resuming where the program stopped) or the one asked for."""


@dataclasses.dataclass(frozen=True)
class ProgramResult:
    """What training a program did: one result per stage this call went through."""

    out: Path
    stages: tuple[TrainResult, ...]

    @property
    def last(self) -> TrainResult:
        return self.stages[-1]

    @property
    def blueprint(self) -> Blueprint:
        return self.last.blueprint

    @property
    def history(self) -> RunHistory:
        """The last stage's: how the program's run ended."""
        return self.last.history

    @property
    def records(self) -> list[StepRecord]:
        """The steps trained by this call, stage after stage."""
        return [r for result in self.stages for r in result.records]

    @property
    def diverged(self) -> bool:
        return self.history.diverged

    @property
    def found_complete_at(self) -> int | None:
        """The last stage's step when every stage was found complete (nothing trained)."""
        if all(r.found_complete_at is not None for r in self.stages):
            return self.last.found_complete_at
        return None


def boundary_checkpoint(out: Path, name: str, steps: int) -> Path:
    """Where the boundary (final) checkpoint of stage ``name`` of ``steps`` steps lies."""
    return out / name / "checkpoints" / f"step_{steps:08d}"


def _has_checkpoint(folder: Path) -> bool:
    return any((path / "meta.json").is_file() for path in folder.glob("checkpoints/step_*"))


def _windows(program: Program, steps: list[int]) -> list[tuple[int, int]]:
    """(schedule offset, schedule steps) of every stage with ``steps`` per stage: a stage
    that continues the schedule (offset > 0 in the program) joins the one before."""
    segments: list[list[int]] = []
    for index, stage in enumerate(program):
        if stage.schedule_offset and segments:
            segments[-1].append(index)
        else:
            segments.append([index])
    windows: list[tuple[int, int]] = [(0, 0)] * len(steps)
    for segment in segments:
        total, offset = sum(steps[i] for i in segment), 0
        for index in segment:
            windows[index] = (offset, total)
            offset += steps[index]
    return windows


def _select(program: Program, stage: str | None) -> list[int]:
    if stage is None:
        return list(range(len(program)))
    if stage not in program.names:
        raise StageRefused(
            f"--stage {stage}: no such stage; the program has {', '.join(program.names)}"
            + did_you_mean(stage, program.names)
        )
    return [program.names.index(stage)]


def plan_stages(
    blueprint: Blueprint,
    settings: TrainSettings,
    *,
    proxy: bool,
    world: int,
    stage: str | None = None,
) -> tuple[Program, Path, list[int], list[PlannedStage]]:
    """(the program, its run folder, every stage's steps, the stages to train) for
    ``blueprint``'s program: all stages, or ``stage`` alone.

    Raises :class:`StageRefused` for a ``stage`` the program lacks (naming the closest) or
    one whose predecessor has no boundary checkpoint yet, and :class:`CannotResume` for
    ``resume`` with no checkpoint in any stage.
    """
    program = resolve_program(blueprint)
    selected = _select(program, stage)
    trained = [s.blueprint for s in program]
    if proxy:
        trained = derive_program_proxy(trained)
    out = (settings.out or Path("runs") / trained[0].meta.name).resolve()  # NAME(-proxy)
    steps = [settings.steps or bp.training_steps for bp in trained]
    windows = _windows(program, steps)
    policy = settings.checkpoints
    if policy.resume and not any(_has_checkpoint(out / name) for name in program.names):
        raise CannotResume(
            f"{out}: no stage of {blueprint.meta.name} has a checkpoint to resume from"
        )
    planned = []
    for index in selected:
        source = program.stages[index]
        previous = None
        if index:
            before = program.names[index - 1]
            previous = boundary_checkpoint(out, before, steps[index - 1])
            if stage is not None and not (previous / "meta.json").is_file():
                raise StageRefused(
                    f"--stage {stage}: stage {before!r} before it has no boundary checkpoint "
                    f"yet ({previous}); train it first (factory train ... --stage {before}), "
                    "or leave out --stage to train the program in order"
                )
        run = StageRun(
            source.name, index, *windows[index], previous,
            source.carry.optimizer, source.carry.data_position,
        )  # fmt: skip
        stage_settings = dataclasses.replace(
            settings,
            out=out / source.name,
            steps=steps[index],
            data=_stage_data(program, index, out, settings.data),
            checkpoints=dataclasses.replace(policy, resume=False),
        )
        if proxy:
            bp, changes = derive_proxy_layout(source.blueprint, world, proxy=trained[index])
        else:
            bp, changes = trained[index], []
        planned.append(PlannedStage(bp, list(changes), stage_settings, run, source))
    return program, out, steps, planned


def _stage_data(program: Program, index: int, out: Path, data: Path | None) -> Path | None:
    """The shards stage ``index`` trains on: ``data/<stage>/``, or (None) its own, built into
    its folder; its predecessor's when it carries the data position (the program checked
    they are one recipe at one length, and a position names samples of one set)."""
    root = index
    while root and program.stages[root].carry.data_position:
        root -= 1
    name = program.names[root]
    if data is not None:
        return data / name
    return None if root == index else out / name / "data"


def run_program(request: ProgramRequest) -> ProgramResult:
    """Train the request's stages in order, each into its folder, recording ``program.json``.

    Stops after a stage that did not complete (a stop signal, a monitor's stop): the
    result's last stage says how it ended, and a rerun resumes there. Raises what
    :func:`~factory.jobs.train.run_training` raises.
    """
    # This rank's share of the work imports torch: ``factory.train`` resolves without it.
    from factory.jobs.train_rank import run_rank
    from factory.runtime.ranks import joined_process_group

    results: list[TrainResult] = []
    main = os.environ.get("RANK", "0") == "0"
    # One launch, one world size (the launch checks) and one process group for every stage.
    with joined_process_group(request.stages[0].blueprint.parallelism.world_size):
        for stage in request.stages:
            assert stage.stage is not None
            if main:
                _record(request, stage.stage.name, "running")
            result = run_rank(stage)
            results.append(result)
            end = result.history.end
            if main:
                _record(request, stage.stage.name, end, boundary=end == "completed")
            if end != "completed":
                break
    return ProgramResult(request.out, tuple(results))


def _record(request: ProgramRequest, name: str, status: str, *, boundary: bool = False) -> None:
    """Rewrite ``program.json`` with stage ``name``'s ``status`` (and its boundary)."""
    path = request.out / PROGRAM_FILE
    known = {entry["name"]: entry for entry in _entries(path)}
    stages = []
    for stage, steps in zip(request.names, request.steps, strict=True):
        entry = known.get(stage, {})
        if entry.get("steps") != steps:  # another length: what it said is of another run
            entry = {}
        entry = {"name": stage, "status": entry.get("status", "pending"), "steps": steps,
                 "boundary": entry.get("boundary")}  # fmt: skip
        if stage == name:
            entry["status"] = status
            checkpoint = boundary_checkpoint(request.out, name, steps)
            entry["boundary"] = (
                {"step": steps, "checkpoint": str(checkpoint.relative_to(request.out))}
                if boundary
                else None
            )
        stages.append(entry)
    document = {"blueprint": request.blueprint.meta.name, "stages": stages}
    request.out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(document, indent=2) + "\n")


def _entries(path: Path) -> Iterator[dict[str, Any]]:
    """The stages of an existing ``program.json`` (none when absent or unreadable)."""
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return
    stages = document.get("stages") if isinstance(document, dict) else None
    for entry in stages if isinstance(stages, list) else []:
        if isinstance(entry, dict) and isinstance(entry.get("name"), str):
            yield entry
