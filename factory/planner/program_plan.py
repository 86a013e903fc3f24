"""``plan_program``: the plan of every stage of a program, and the program's totals.

Each stage is planned alone (:func:`factory.planner.plan.plan` on the stage's resolved
blueprint, ``factory.schemas.program``), with its own sequence length, layout, batch and
token budget; the totals add what adds up across stages (tokens, steps, FLOPs, time,
GPU-hours, energy, interruptions). The peak memory of a rank does not add: each stage has
its own, and the program's is the largest.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from factory.planner.plan import Plan, plan
from factory.schemas.blueprint import Blueprint
from factory.schemas.program import Program

__all__ = ["ProgramPlan", "ProgramTotals", "StagePlan", "plan_program"]


@dataclass(frozen=True)
class StagePlan:
    """One stage's plan and its place in the program."""

    name: str
    index: int
    plan: Plan
    seq_len: int
    schedule_offset: int
    schedule_steps: int

    @property
    def tokens(self) -> int:
        return self.plan.tokens_per_step * self.plan.steps

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "index": self.index,
            "seq_len": self.seq_len,
            "tokens": self.tokens,
            "steps": self.plan.steps,
            "schedule": {"offset": self.schedule_offset, "steps": self.schedule_steps},
            "plan": self.plan.to_dict(),
        }


@dataclass(frozen=True)
class ProgramTotals:
    """What the stages add up to; ``memory_per_rank_bytes`` is the largest stage's peak."""

    tokens: int
    steps: int
    total_flops: float
    wall_seconds: float
    gpu_hours: float
    energy_mwh: float
    expected_interruptions: float
    memory_per_rank_bytes: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "tokens": self.tokens,
            "steps": self.steps,
            "total_flops": self.total_flops,
            "wall_seconds": self.wall_seconds,
            "wall_days": self.wall_seconds / 86400,
            "gpu_hours": self.gpu_hours,
            "energy_mwh": self.energy_mwh,
            "expected_interruptions": self.expected_interruptions,
            "memory_per_rank_bytes": self.memory_per_rank_bytes,
        }


@dataclass(frozen=True)
class ProgramPlan:
    """Every stage's plan, in order, and their totals."""

    name: str
    declared: bool
    """False for a blueprint without ``stages`` (one implicit stage)."""
    stages: tuple[StagePlan, ...]

    @property
    def totals(self) -> ProgramTotals:
        plans = [stage.plan for stage in self.stages]
        return ProgramTotals(
            tokens=sum(stage.tokens for stage in self.stages),
            steps=sum(p.steps for p in plans),
            total_flops=sum(p.total_training_flops for p in plans),
            wall_seconds=sum(p.cost.wall_seconds for p in plans),
            gpu_hours=sum(p.cost.gpu_hours for p in plans),
            energy_mwh=sum(p.cost.energy_mwh for p in plans),
            expected_interruptions=sum(p.failures.expected_interruptions for p in plans),
            memory_per_rank_bytes=max(p.memory.total for p in plans),
        )

    def stage(self, name: str) -> StagePlan:
        """The stage called ``name``; KeyError naming the known ones otherwise."""
        for stage in self.stages:
            if stage.name == name:
                return stage
        known = ", ".join(stage.name for stage in self.stages)
        raise KeyError(f"no stage {name!r}; the program has {known}")

    def to_dict(self) -> dict[str, Any]:
        """``factory plan --json`` of a program: the shared model's numbers once, then each
        stage's whole plan and the totals. A blueprint without stages keeps the one-stage
        document (:meth:`Plan.to_dict`)."""
        if not self.declared:
            return self.stages[0].plan.to_dict()
        first = self.stages[0].plan
        return {
            "name": self.name,
            "params": first.to_dict()["params"],
            "stages": [stage.to_dict() for stage in self.stages],
            "totals": self.totals.to_dict(),
        }


def plan_program(
    program: Program, shrink: Callable[[Blueprint], Blueprint] | None = None
) -> ProgramPlan:
    """Plan each stage of ``program`` alone; ``shrink`` first maps a stage's blueprint (to
    its CPU proxy, ``factory.proxy.derive_proxy``)."""
    stages = []
    for stage in program:
        blueprint = shrink(stage.blueprint) if shrink is not None else stage.blueprint
        stages.append(
            StagePlan(
                stage.name,
                stage.index,
                plan(blueprint),
                blueprint.data.seq_len,
                stage.schedule_offset,
                stage.schedule_steps,
            )
        )
    name = program.final.blueprint.meta.name
    return ProgramPlan(name, program.declared, tuple(stages))
