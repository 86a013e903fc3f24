"""The verdicts of ``factory build``'s training stages: did the loss fall, do the layouts agree."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from factory.report.run_metrics import read_metrics

__all__ = ["LOSS_TOLERANCE", "Comparison", "Fall", "compare_losses", "loss_falls", "run_losses"]

MIN_FALL = 0.05
"""The smoke run passes when its last quarter's mean LM loss is at least 5% below its first
quarter's: a proxy that learns nothing (a broken graph, data or optimizer) stays flat."""

LOSS_TOLERANCE = 5e-3
"""Largest relative LM-loss difference allowed between the 2-rank layout and one process.
Not bitwise: the reductions run in another order and stochastic rounding draws other
numbers on each rank; docs/build.md gives the measured differences."""


def run_losses(run: Path) -> list[float]:
    """The LM loss of every step of the run in ``run``, in step order (a step redone after a
    resume counts once, as redone)."""
    by_step: dict[int, float] = {}
    for record in read_metrics(run).steps:
        by_step[record.step] = record.lm_loss
    return [by_step[step] for step in sorted(by_step)]


@dataclass(frozen=True)
class Fall:
    first: float
    last: float

    @property
    def fraction(self) -> float:
        return 1 - self.last / self.first if self.first else 0.0

    @property
    def fell(self) -> bool:
        return self.fraction >= MIN_FALL

    def describe(self) -> str:
        return (
            f"LM loss {self.first:.3f} -> {self.last:.3f} (first and last quarter; "
            f"{self.fraction:.0%} lower, {MIN_FALL:.0%} needed)"
        )


def loss_falls(losses: list[float]) -> Fall:
    """Mean of the first and of the last quarter of ``losses`` (at least one step each)."""
    if len(losses) < 2:
        raise ValueError(f"a fall needs at least 2 steps, got {len(losses)}")
    quarter = max(1, len(losses) // 4)
    first = sum(losses[:quarter]) / quarter
    last = sum(losses[-quarter:]) / quarter
    return Fall(first, last)


@dataclass(frozen=True)
class Comparison:
    max_relative_difference: float
    tolerance: float

    @property
    def passed(self) -> bool:
        return self.max_relative_difference <= self.tolerance

    def describe(self) -> str:
        return (
            f"largest relative LM-loss difference {self.max_relative_difference:.1e} "
            f"({'<=' if self.passed else '>'} {self.tolerance:.0e})"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "max_relative_difference": self.max_relative_difference,
            "tolerance": self.tolerance,
            "passed": self.passed,
        }


def compare_losses(
    losses: list[float], reference: list[float], tolerance: float = LOSS_TOLERANCE
) -> Comparison:
    """Step-by-step relative difference of ``losses`` against ``reference`` (same steps)."""
    if len(losses) != len(reference) or not losses:
        raise ValueError(f"{len(losses)} losses against {len(reference)} reference losses")
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses, reference, strict=True))
    return Comparison(worst, tolerance)
