"""What the sections of ``python -m benchmarks gpu`` share: the context a section writes its
results into (saved after every part, so a section cut off by its budget keeps what it
measured), device timing, and the device's peaks from factory's GPU table."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

__all__ = ["SectionContext", "attempt", "bf16_peak", "gpu_key", "median_seconds", "sync", "timed"]


@dataclass
class SectionContext:
    """One section's run: where, how big, and the JSON-able results it has so far."""

    device: torch.device
    dry_run: bool
    path: Path
    """The section's own results file (``DIR/sections/NAME.json``)."""
    results: dict[str, Any] = field(default_factory=dict)

    def record(self, key: str, value: Any) -> None:
        """Keep ``value`` under ``key`` and write the results file now."""
        self.results[key] = value
        self.path.write_text(json.dumps(self.results, indent=2) + "\n", encoding="utf-8")

    def fail(self, message: str) -> None:
        """A check that did not hold: the section is reported failed (it still goes on)."""
        self.record("failures", [*self.results.get("failures", []), message])


def attempt(ctx: SectionContext, what: str, run: Callable[[], Any]) -> Any:
    """``run()``, or None with the error recorded as a failure: one part of a section failing
    must not cost the parts after it."""
    try:
        return run()
    except Exception as error:
        ctx.fail(f"{what}: {type(error).__name__}: {error}")
        return None


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on CPU, where calls are synchronous)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(run: Callable[[], object], device: torch.device) -> float:
    """Wall seconds of one call, between device synchronizations."""
    sync(device)
    start = time.perf_counter()
    run()
    sync(device)
    return time.perf_counter() - start


def median_seconds(
    run: Callable[[], object], device: torch.device, repeats: int, warmup: int = 1
) -> float:
    """Median seconds of one call after ``warmup`` untimed calls (compiles, allocations)."""
    for _ in range(warmup):
        run()
    times = sorted(timed(run, device) for _ in range(repeats))
    return times[len(times) // 2]


def gpu_key(device: torch.device) -> str | None:
    """The device's entry in factory's GPU table (``h100``...), matched by its name; None on
    CPU or for a GPU not in the table."""
    if device.type != "cuda":
        return None
    from factory.schemas.parallelism import GPU_SPECS

    name = torch.cuda.get_device_name(device).lower()
    return next((key for key in GPU_SPECS if key in name), None)


def bf16_peak(device: torch.device) -> float | None:
    """The device's dense BF16 peak in FLOP/s (the MFU denominator), or None."""
    from factory.schemas.parallelism import GPU_SPECS

    key = gpu_key(device)
    return None if key is None else GPU_SPECS[key].bf16_dense_flops


def table(header: list[str], rows: list[list[Any]]) -> str:
    """A Markdown table (numbers right-aligned)."""
    # A column is numeric by its first value given (a row may leave a cell None: n/a).
    columns = list(zip(*rows, strict=True)) if rows else [()] * len(header)
    firsts = [next((v for v in column if v is not None), None) for column in columns]
    align = ["--:" if isinstance(v, int | float) else "---" for v in firsts]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|"]
    lines += ["| " + " | ".join(_cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def _cell(value: Any) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:,.4g}"
    return str(value)
