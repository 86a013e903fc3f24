"""Interleaved timing of competing step functions, so machine noise hits each alike."""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable

__all__ = ["interleaved", "load_average", "report"]

Step = Callable[[], float]
"""Runs once and returns its own wall time in seconds."""


def interleaved(steps: dict[str, Step], repeats: int, warmup: int) -> dict[str, list[float]]:
    """``warmup`` untimed rounds, then ``repeats`` rounds calling each step once, in order."""
    for _ in range(warmup):
        for step in steps.values():
            step()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            times[name].append(step())
    return times


def report(times: dict[str, list[float]], tokens: int | None = None) -> dict[str, float]:
    """Print each step's median (and spread, and tokens/s when given); return the medians."""
    median = {name: statistics.median(ts) for name, ts in times.items()}
    width = max(map(len, times))
    for name, seconds in median.items():
        spread = f"min {min(times[name]):.3f}, max {max(times[name]):.3f}"
        rate = f": {tokens / seconds:,.0f} tokens/s" if tokens else ""
        print(f"{name:{width}s} median step {seconds:.3f} s ({spread}){rate}")
    return median


def load_average() -> float:
    """The 1-minute load average, printed beside timings to show a busy machine."""
    return os.getloadavg()[0]
