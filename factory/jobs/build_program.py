"""What ``factory build`` needs of a program (a blueprint with ``stages``): the planned
program as the page draws it, the curations its stages share, and the smoke run's verdict
per stage.

The planned program is the full-size one, every number from the stages' resolved
blueprints (:func:`factory.schemas.program.resolve_program`): tokens, steps, sequence
length, batch, layout, the planner's time, GPU-hours and memory per rank of each stage
alone (:func:`factory.planner.program_plan.plan_program`), and the learning rate at
points of every stage, from the torch-free
:func:`factory.runtime.schedule.learning_rate` at ``schedule_offset + step`` of the
schedule the stage belongs to (so a decay spanning two stages is drawn as one curve).

The smoke run trains each stage's proxy (:func:`factory.proxy.derive_program_proxy`: one
proxy model for every stage, each stage at its own proxy sequence length) on that stage's
recipe packed to that length.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from factory.planner.program_plan import StagePlan, plan_program
from factory.proxy import derive_program_proxy
from factory.runtime.schedule import learning_rate
from factory.schemas.blueprint import Blueprint
from factory.schemas.program import Program, ProgramStage

__all__ = [
    "LR_POINTS",
    "MIN_FALL",
    "Curation",
    "StageFall",
    "curations",
    "program_plan",
    "stage_fall",
    "stage_proxies",
]

LR_POINTS = 96
"""Learning-rate samples per stage in the planned program: enough for a smooth curve on a
page; the first and last step of the stage are always among them."""

LAYOUT_FIELDS = ("world_size", "tp", "cp", "ep", "pp")


def _lr_samples(stage: ProgramStage) -> list[tuple[int, float]]:
    steps, training = stage.steps, stage.blueprint.training
    if steps <= 0:
        return []
    count = min(steps, LR_POINTS)
    picked = sorted({round(i * (steps - 1) / max(1, count - 1)) for i in range(count)})
    # The schedule's own turning points (end of warmup, start of decay) as exact samples.
    window = range(stage.schedule_offset, stage.schedule_offset + steps)
    sched, total = training.schedule, stage.schedule_steps
    turns = {round(sched.warmup_fraction * total) - 1, round(sched.warmup_fraction * total)}
    if sched.kind == "wsd":
        decay = max(1, round(sched.decay_fraction * total))
        turns |= {total - decay - 1, total - decay}
    picked = sorted(set(picked) | {t - stage.schedule_offset for t in turns if t in window})
    return [(s, learning_rate(stage.schedule_offset + s, total, training)) for s in picked]


def stage_proxies(program: Program) -> list[Blueprint]:
    """Each program stage's proxy, in order, as the smoke run trains it."""
    return derive_program_proxy([stage.blueprint for stage in program])


def _predicted(planned: StagePlan) -> dict[str, Any]:
    """The planner's figures for the stage alone at full size (``factory plan --stage``)."""
    result = planned.plan
    return {
        "tokens_per_s_per_gpu": result.performance.tokens_per_s_per_gpu,
        "wall_seconds": result.cost.wall_seconds,
        "gpu_hours": result.cost.gpu_hours,
        "memory_per_rank_bytes": result.memory.total,
    }


def _stage_record(stage: ProgramStage, proxy: Blueprint) -> dict[str, Any]:
    bp = stage.blueprint
    par, schedule, optimizer = bp.parallelism, bp.training.schedule, bp.training.optimizer
    return {
        "name": stage.name,
        "index": stage.index,
        "recipe": bp.data.recipe,
        "seq_len": bp.data.seq_len,
        "proxy_seq_len": proxy.data.seq_len,
        "global_batch_size": par.global_batch_size,
        "steps": stage.steps,
        "tokens": stage.steps * bp.tokens_per_step,
        "layout": {name: getattr(par, name) for name in LAYOUT_FIELDS},
        "gpu": par.gpu,
        "precision": bp.precision.recipe,
        "carry": stage.carry.model_dump(mode="json"),
        "schedule": {
            "kind": schedule.kind,
            "lr": optimizer.lr,
            "min_lr": optimizer.min_lr,
            "offset": stage.schedule_offset,
            "steps": stage.schedule_steps,
        },
        "lr": [[step, rate] for step, rate in _lr_samples(stage)],
    }


def program_plan(blueprint: Blueprint, program: Program) -> dict[str, Any]:
    """The planned program: every stage's full-size numbers, in order (``program_plan.json``)."""
    written = {stage.name: stage.description for stage in blueprint.stages or []}
    planned = plan_program(program)
    stages = [
        {
            **_stage_record(stage, proxy),
            "description": written.get(stage.name, ""),
            "predicted": _predicted(planned.stage(stage.name)),
        }
        for stage, proxy in zip(program, stage_proxies(program), strict=True)
    ]
    totals = planned.totals
    return {
        "name": blueprint.meta.name,
        "stages": stages,
        "tokens": sum(s["tokens"] for s in stages),
        "steps": sum(s["steps"] for s in stages),
        "predicted": {
            "wall_seconds": totals.wall_seconds,
            "gpu_hours": totals.gpu_hours,
            "memory_per_rank_bytes": totals.memory_per_rank_bytes,
        },
    }


@dataclass(frozen=True)
class Curation:
    """One curation of the data stage: a recipe at a sequence length, and the stages that
    train on it (the first names the folder it is built in; the others get linked copies)."""

    recipe: str
    seq_len: int
    stages: tuple[str, ...]


def curations(program: Program) -> list[Curation]:
    """The curations a program's smoke run needs, in stage order: one per distinct recipe and
    proxy sequence length, since a curation is a function of those two alone."""
    found: dict[tuple[str, int], list[str]] = {}
    for stage, proxy in zip(program, stage_proxies(program), strict=True):
        key = (stage.blueprint.data.recipe, proxy.data.seq_len)
        found.setdefault(key, []).append(stage.name)
    return [Curation(recipe, seq_len, tuple(names)) for (recipe, seq_len), names in found.items()]


MIN_FALL = 0.05
"""The first stage starts from initialised weights: its last quarter's mean LM loss must be
at least 5% below its first quarter's (the single-stage build's criterion)."""


@dataclass(frozen=True)
class StageFall:
    """The smoke run's verdict on one stage.

    The first stage starts from initialised weights and must learn: its last quarter's mean
    LM loss at least :data:`MIN_FALL` below its first quarter's. A later stage starts from
    the weights the stage before left, on a new mixture, often at another length and a far
    smaller learning rate, and a few steps of it say nothing about learning: its batches
    differ in difficulty more than a few steps of training move the loss. Measured on the
    Nano proxy's SFT stage (8 steps): trained at its learning rate its LM loss went 5.04 ->
    6.19; with the learning rate at 1e-12, on the same batches, 5.04 -> 6.22. So a later
    stage is judged on what a few steps can show: every loss finite, and its last quarter's
    mean below the program's start (the first stage's first quarter: the untrained model's
    loss, about ln(vocab)), which a stage that lost the weights, or diverged, is not.
    """

    stage: str
    first: float
    """Mean LM loss of the stage's first quarter of steps."""
    last: float
    """Mean LM loss of its last quarter."""
    start: float | None
    """The program's first quarter's mean LM loss, for a later stage; None for the first."""
    finite: bool = True
    """Every step's LM loss is finite."""

    @property
    def fraction(self) -> float:
        return 1 - self.last / self.first if self.first else 0.0

    @property
    def passed(self) -> bool:
        if not self.finite:
            return False
        if self.start is None:
            return self.fraction >= MIN_FALL
        return self.last < self.start

    def describe(self) -> str:
        if not self.finite:
            return f"LM loss not finite in stage {self.stage}"
        change = f"LM loss {self.first:.3f} -> {self.last:.3f} ({-self.fraction:+.0%}; "
        if self.start is None:
            return f"{change}from initialised weights, falls {MIN_FALL:.0%} or more)"
        return f"{change}from the stage before's weights, ends below the start {self.start:.3f})"

    def to_dict(self) -> dict[str, Any]:
        return {"first": self.first, "last": self.last, "start": self.start,
                "passed": self.passed, "verdict": self.describe()}  # fmt: skip


def stage_fall(stage: str, losses: list[float], start: float | None) -> StageFall:
    """The verdict on a stage's ``losses`` (first and last quarter, one step at least each);
    ``start`` is the program's first quarter's mean LM loss, None for the first stage."""
    if len(losses) < 2:
        raise ValueError(f"stage {stage}: a verdict needs at least 2 steps, got {len(losses)}")
    quarter = max(1, len(losses) // 4)
    first = sum(losses[:quarter]) / quarter
    last = sum(losses[-quarter:]) / quarter
    finite = all(math.isfinite(loss) for loss in losses)
    return StageFall(stage, first, last, start, finite)
