"""``plan_program``: the plan of every stage of a program, and the program's totals.

Each stage is planned alone (:func:`factory.planner.plan.plan` on the stage's resolved
blueprint, ``factory.schemas.program``), with its own sequence length, layout, batch and
token budget; the totals add what adds up across stages (tokens, steps, FLOPs, time,
GPU-hours, energy, interruptions). The peak memory of a rank does not add: each stage has
its own, and the program's is the largest.

Given the curated data (``factory train --data``'s folder, or a run's ``data/``: one
``manifest.json`` for a blueprint without stages, ``<stage>/manifest.json`` per stage of a
program), each stage also says how many epochs its steps make over the packed samples
the build wrote (the loader reads them in a fresh order each epoch).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from factory.data.shards.manifest import read_manifest
from factory.planner.plan import Plan, plan
from factory.schemas.blueprint import Blueprint
from factory.schemas.program import Program, ProgramStage

__all__ = [
    "CuratedData",
    "ProgramPlan",
    "ProgramTotals",
    "StagePlan",
    "curated_folder",
    "plan_program",
    "plan_stage",
]


@dataclass(frozen=True)
class CuratedData:
    """What a stage's built data holds, from its ``manifest.json``."""

    samples: int
    tokens: int
    """Real tokens in the samples (padding excluded)."""
    seq_len: int

    @classmethod
    def read(cls, folder: Path) -> CuratedData:
        """``ManifestError`` where ``folder`` holds no readable manifest."""
        packing = read_manifest(folder)["packing"]
        return cls(int(packing["samples"]), int(packing["tokens"]), int(packing["seq_len"]))

    def to_dict(self) -> dict[str, int]:
        return {"samples": self.samples, "tokens": self.tokens, "seq_len": self.seq_len}


@dataclass(frozen=True)
class StagePlan:
    """One stage's plan and its place in the program."""

    name: str
    index: int
    plan: Plan
    seq_len: int
    schedule_offset: int
    schedule_steps: int
    curated: CuratedData | None = None
    """The stage's built data; None: not given."""

    @property
    def tokens(self) -> int:
        return self.plan.tokens_per_step * self.plan.steps

    @property
    def epochs(self) -> float | None:
        """Passes over the curated samples the stage's steps make."""
        if self.curated is None or not self.curated.samples:
            return None
        return self.plan.steps * self.plan.layout.global_batch_size / self.curated.samples

    def curated_dict(self) -> dict[str, Any] | None:
        if self.curated is None:
            return None
        return {**self.curated.to_dict(), "epochs": self.epochs}

    def alone_dict(self) -> dict[str, Any]:
        """The stage as ``factory plan`` prints one blueprint's plan (with ``curated`` where
        its data was given)."""
        out = self.plan.to_dict()
        if self.curated is not None:
            out["curated"] = self.curated_dict()
        return out

    def to_dict(self) -> dict[str, Any]:
        out = {
            "name": self.name,
            "index": self.index,
            "seq_len": self.seq_len,
            "tokens": self.tokens,
            "steps": self.plan.steps,
            "schedule": {"offset": self.schedule_offset, "steps": self.schedule_steps},
            "plan": self.plan.to_dict(),
        }
        if self.curated is not None:
            out["curated"] = self.curated_dict()
        return out


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
            return self.stages[0].alone_dict()
        return {
            "name": self.name,
            "params": asdict(self.stages[0].plan.params),
            "stages": [stage.to_dict() for stage in self.stages],
            "totals": self.totals.to_dict(),
        }


def curated_folder(data: Path, stage: ProgramStage) -> Path:
    """Where a stage's built data lies under ``data``: ``data/<stage>/`` in a declared
    program (the build's ``data/<stage>/``), ``data`` itself for a blueprint without stages."""
    return data / stage.name if stage.declared else data


def plan_stage(
    stage: ProgramStage,
    shrink: Callable[[Blueprint], Blueprint] | None = None,
    data: Path | None = None,
) -> StagePlan:
    """Plan one stage alone; ``shrink`` first maps its blueprint (to its CPU proxy,
    ``factory.proxy.derive_proxy``); ``data``: the built data, whose manifest gives the
    stage's curated samples (``ManifestError`` where it is missing)."""
    blueprint = shrink(stage.blueprint) if shrink is not None else stage.blueprint
    return StagePlan(
        stage.name,
        stage.index,
        plan(blueprint),
        blueprint.data.seq_len,
        stage.schedule_offset,
        stage.schedule_steps,
        None if data is None else CuratedData.read(curated_folder(data, stage)),
    )


def plan_program(
    program: Program,
    shrink: Callable[[Blueprint], Blueprint] | None = None,
    data: Path | None = None,
) -> ProgramPlan:
    """Plan each stage of ``program`` alone (:func:`plan_stage`); the program is named as
    what was planned (``nano-proxy`` under a proxy's ``shrink``), as one stage's plan is."""
    stages = tuple(plan_stage(stage, shrink, data) for stage in program)
    return ProgramPlan(stages[-1].plan.name, program.declared, stages)
