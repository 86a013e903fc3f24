"""A small program (phase 1 -> phase 2 -> SFT) on the rule tests' base blueprint, shared by the
export tests."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from blueprint_factory import BASE

from factory.schemas import Blueprint
from factory.schemas.training import TrainingConfig

__all__ = ["HAS_OBJECTIVE", "STAGES", "needs_objective", "program", "with_stage"]

HAS_OBJECTIVE = "objective" in TrainingConfig.model_fields
needs_objective = pytest.mark.skipif(not HAS_OBJECTIVE, reason="no training.objective schema")
SFT = {"objective": {"kind": "sft"}} if HAS_OBJECTIVE else {}


# Phase 1 -> phase 2 (one WSD schedule over both, TP changes with the optimizer carried) ->
# SFT (fresh optimizer and schedule, a chat recipe, longer sequences, a smaller world).
STAGES: list[dict[str, Any]] = [
    {"name": "phase1", "training": {"steps": 60}},
    {
        "name": "phase2",
        "continue_schedule": True,
        "data": {"recipe": "super"},
        "parallelism": {"tp": 2, "sequence_parallel": True},
        "training": {"steps": 40},
    },
    {
        "name": "sft",
        "carry": {"optimizer": False},
        "data": {"recipe": "super_sft", "seq_len": 2048},
        "parallelism": {"world_size": 4, "global_batch_size": 8},
        "training": {
            "steps": 30,
            "optimizer": {"lr": 1e-5},
            "schedule": {"kind": "cosine"},
            **SFT,
        },
    },
]


def program(stages: list[dict[str, Any]] = STAGES, **base: Any) -> Blueprint:
    document = copy.deepcopy(BASE) | {"stages": copy.deepcopy(stages)}
    for dotted, value in base.items():
        *parents, leaf = dotted.split(".")
        node = document
        for key in parents:
            node = node[key]
        node[leaf] = value
    return Blueprint.model_validate(document)


def with_stage(index: int, **changes: Any) -> list[dict[str, Any]]:
    """STAGES with stage ``index``'s sections updated (one level deep)."""
    stages = copy.deepcopy(STAGES)
    for section, value in changes.items():
        if isinstance(value, dict):
            stages[index].setdefault(section, {}).update(value)
        else:
            stages[index][section] = value
    return stages
