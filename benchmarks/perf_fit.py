"""Fit the performance model's constants to published step times, deterministically.

The predicted step time is linear in the coefficients (``sum_j c_j x_j``: each x_j is
an ideal time), except for the GEMM shape constant d0 and two choices the coefficients
make (the slowest pipeline rank, the DP overlap window). So, for each d0 of a fixed
grid: start from round coefficients, compute every row's ideal times x_j, minimise the
squared log error ``log(x . c) - log t`` (damped Gauss-Newton, each coefficient kept
above its lower bound), and recompute the x_j with the new coefficients; three rounds.
Each row's error weighs ``1 / sqrt(rows of its family)``, so Llama's 100 rows do not
drown Nemotron-H's 7. The d0 with the smallest
sum of squared log errors wins. Coefficients are rounded to 6 significant digits, so
the stored file is reproducible bit for bit wherever numpy's float64 is IEEE.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from benchmarks.perf_rows import Row
from factory.planner.layout import resolve_layout
from factory.planner.perf_constants import COEFFICIENTS, LOWER_BOUNDS, PerfConstants
from factory.planner.performance import inputs_of, step_terms

__all__ = [
    "D0_GRID",
    "Fit",
    "abs_error",
    "fit",
    "measured_seconds",
    "median",
    "predicted_seconds",
]

D0_GRID = (128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0)
_ROUNDS = 3
_GAUSS_NEWTON_STEPS = 30
_FLOOR = 1e-9
"""A coefficient without a bound in LOWER_BOUNDS is kept above this."""
_DAMPING = 1e-4
_START = {
    "gemm_hopper": 1.5,
    "gemm_blackwell": 1.5,
    "core": 2.0,
    "scan": 2.0,
    "memory": 1.5,
    "comm": 1.0,
    "overhead": 1e-4,
    "routing_sync": 1e-3,
}
"""Where every fit starts: round numbers, so the result depends on the rows only."""


@dataclass(frozen=True)
class Fit:
    constants: PerfConstants
    log_sse: float
    """The family-weighted sum of squared log errors it reached."""
    rows: int


def measured_seconds(row: Row) -> float:
    bp = row.blueprint
    tokens = bp.parallelism.global_batch_size * bp.data.seq_len
    return tokens / (row.tokens_per_s_per_gpu * row.num_gpus)


def _features(row: Row, constants: PerfConstants) -> np.ndarray:
    bp = row.blueprint
    terms = step_terms(inputs_of(bp), resolve_layout(bp), bp.model, constants)
    out = dict.fromkeys(COEFFICIENTS, 0.0)
    for _, _, name, seconds in terms:
        out[name] += seconds
    return np.array([out[name] for name in COEFFICIENTS])


def predicted_seconds(row: Row, constants: PerfConstants) -> float:
    coefficients = np.array([constants.coefficients[name] for name in COEFFICIENTS])
    return float(_features(row, constants) @ coefficients)


def _gauss_newton(
    x: np.ndarray, t: np.ndarray, c: np.ndarray, floor: np.ndarray, w: np.ndarray
) -> np.ndarray:
    """Minimise sum(log(x.c / t)^2) with c = floor + exp(u), so every coefficient stays above
    its bound; damped (Levenberg) steps of at most e in any u."""
    used = np.abs(x).sum(axis=0) > 0
    u = np.log(np.maximum(c - floor, _FLOOR))
    damping = np.sqrt(_DAMPING) * np.eye(int(used.sum()))
    for _ in range(_GAUSS_NEWTON_STEPS):
        excess = np.exp(u)
        pred = x @ (floor + excess)
        residual = w * np.log(pred / t)
        jacobian = w[:, None] * x * excess / pred[:, None]
        system = np.vstack([jacobian[:, used], damping])
        rhs = np.concatenate([-residual, np.zeros(len(damping))])
        step = np.zeros_like(u)
        step[used] = np.linalg.lstsq(system, rhs, rcond=None)[0]
        u = u + np.clip(step, -1.0, 1.0)
    return floor + np.exp(u)


def _rounded(value: float) -> float:
    return float(f"{value:.6g}")


def _constants(c: np.ndarray, d0: float) -> PerfConstants:
    return PerfConstants(
        coefficients={name: _rounded(v) for name, v in zip(COEFFICIENTS, c, strict=True)},
        gemm_shape_d0=d0,
    )


def _fit_d0(rows: Sequence[Row], d0: float, t: np.ndarray) -> tuple[PerfConstants, float]:
    floor = np.array([LOWER_BOUNDS.get(name, _FLOOR) for name in COEFFICIENTS])
    sizes = Counter(row.family for row in rows)
    w = np.array([sizes[row.family] ** -0.5 for row in rows])
    c = np.array([_START[name] for name in COEFFICIENTS])
    constants = _constants(c, d0)
    for _ in range(_ROUNDS):
        x = np.array([_features(row, constants) for row in rows])
        c = _gauss_newton(x, t, c, floor, w)
        constants = _constants(c, d0)
    errors = w * np.log([predicted_seconds(r, constants) for r in rows] / t)
    return constants, float(errors @ errors)


def fit(rows: Sequence[Row]) -> Fit:
    """The constants that best predict ``rows``' published step times."""
    t = np.array([measured_seconds(row) for row in rows])
    best: tuple[PerfConstants, float] | None = None
    for d0 in D0_GRID:
        constants, sse = _fit_d0(rows, d0, t)
        if best is None or sse < best[1] - 1e-12:
            best = (constants, sse)
    assert best is not None
    return Fit(best[0], best[1], len(rows))


def abs_error(row: Row, constants: PerfConstants) -> float:
    """|predicted / measured - 1| of tokens/s (the same as of step time's inverse)."""
    return abs(measured_seconds(row) / predicted_seconds(row, constants) - 1)


def median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2
