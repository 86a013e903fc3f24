"""Numbers for people: a value formatted by what its key's suffix says it measures."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from factory.planner.report import human_bytes, human_duration, human_flops

__all__ = ["format_named_value", "format_number", "percent"]


def format_number(value: float) -> str:
    """Integers with thousands separators; other numbers with about four significant digits."""
    if isinstance(value, int) or (float(value).is_integer() and abs(value) < 1e15):
        return f"{int(value):,}"
    size = abs(value)
    if size < 1e-3 or size >= 1e15:
        return f"{value:.3e}"
    if size >= 1e5:
        return f"{value:,.0f}"
    return f"{value:,.1f}" if size >= 1e3 else f"{value:.4g}"


def percent(fraction: float) -> str:
    return f"{fraction * 100:.3g}%" if abs(fraction) < 0.1 else f"{fraction * 100:.1f}%"


def _with(unit: str) -> Callable[[float], str]:
    return lambda v: f"{format_number(v)} {unit}"


def _seconds(value: float) -> str:
    pretty = human_duration(value)
    return pretty if value < 60 else f"{pretty} ({format_number(value)} s)"


def _hours(value: float) -> str:
    return f"{format_number(value)} h" + (f" ({value / 24:,.1f} days)" if value >= 48 else "")


def _bytes(value: float) -> str:
    return f"{human_bytes(value)} ({format_number(value)} B)"


SUFFIXES: tuple[tuple[str, Callable[[float], str]], ...] = (
    ("_gpu_hours", _with("GPU-hours")),
    ("_per_gpu_hour", _with("per GPU-hour")),
    ("_hours", _hours),
    ("_days", _with("days")),
    ("_seconds", _seconds),
    ("_mwh", _with("MWh")),
    ("_kwh", _with("kWh")),
    ("_watts", _with("W")),
    ("_bytes_per_param", _with("B per parameter")),
    ("_bytes", _bytes),
    ("_fraction", percent),
    ("_flops_per_gpu", lambda v: human_flops(v).replace("FLOP", "FLOP/s")),
    ("_flops", human_flops),
    ("_steps", _with("steps")),
    ("_usd", lambda v: f"${v:,.0f}"),
    ("mfu", percent),
)
"""Key suffix -> formatter; the first match wins, so longer suffixes come first."""


def format_named_value(key: str, value: Any) -> str:
    """``value`` formatted for the unit its ``key`` names (``wall_days`` -> '500.6 days')."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        if isinstance(value, list | tuple):
            return ", ".join(format_named_value(key, v) for v in value)
        return "—" if value is None else str(value)
    leaf = key.rsplit(".", 1)[-1].lower()
    for suffix, formatter in SUFFIXES:
        if leaf.endswith(suffix) or leaf == suffix.lstrip("_"):
            return formatter(value)
    return format_number(value)
