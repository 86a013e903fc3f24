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

__all__ = ["COEFFICIENTS", "LOWER_BOUNDS", "PerfConstants", "perf_constants"]

COEFFICIENTS = (
    "gemm_hopper",
    "gemm_blackwell",
    "core",
    "scan",
    "memory",
    "comm",
    "overhead",
    "routing_sync",
)
"""The linear coefficients, in the fit's order: GEMM time per tensor-core generation, the
fused cores (attention's, and the Mamba conv + SSD scan: ``LayerType.core_coefficient``), memory-bound traffic, exposed communication, seconds per
block per micro-batch (kernel launches) and seconds per routing block per micro-batch (a
dropless router's device-to-host wait for the token counts)."""

LOWER_BOUNDS = {"gemm_hopper": 1.0, "gemm_blackwell": 1.0, "core": 1.0, "scan": 1.0, "memory": 1.0}
"""Nothing runs faster than its data-sheet peak; communication may hide behind compute
(below 1) and overheads may vanish (absent here: bound 0)."""


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
