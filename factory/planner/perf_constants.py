"""The performance model's fitted constants, read from ``perf_constants.json``.

``python -m benchmarks perf_model --fit`` writes that file from the published
measurements in ``benchmarks/data/``; ``docs/performance.md`` says what each constant
means and how it was fitted. Every coefficient multiplies an ideal time (at a
data-sheet peak) into a predicted one: its inverse is an efficiency.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

__all__ = ["COEFFICIENTS", "PerfConstants", "perf_constants"]

COEFFICIENTS = (
    "gemm_hopper",
    "gemm_blackwell",
    "core",
    "memory",
    "comm",
    "overhead",
)
"""The linear coefficients, in the fit's order: GEMM time per tensor-core generation, the
fused attention / scan cores, memory-bound traffic, exposed communication, and seconds per
block per micro-batch pass (kernel launches and synchronisation)."""


@dataclass(frozen=True)
class PerfConstants:
    coefficients: dict[str, float]
    """Each of :data:`COEFFICIENTS`."""
    gemm_shape_d0: float
    """The GEMM shape efficiency is the product over the product's three dimensions of
    d / (d + d0): small dimensions (fine-grained experts, narrow TP shards) run slower."""

    def to_dict(self) -> dict[str, Any]:
        return {"coefficients": dict(self.coefficients), "gemm_shape_d0": self.gemm_shape_d0}


@cache
def perf_constants() -> PerfConstants:
    """The constants shipped with factory (read once)."""
    text = resources.files("factory.planner").joinpath("perf_constants.json").read_text()
    data = json.loads(text)
    return PerfConstants(
        coefficients={name: float(data["coefficients"][name]) for name in COEFFICIENTS},
        gemm_shape_d0=float(data["gemm_shape_d0"]),
    )
