"""Numbers for people: counts, FLOPs, bytes and durations with their units, and a value
formatted by what its key's suffix says it measures. Every report page formats numbers here."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = [
    "format_named_value", "format_number", "human_bytes", "human_count", "human_duration",
    "human_flops", "percent",
]  # fmt: skip


def _scaled(n: float, units: tuple[tuple[str, float], ...]) -> str:
    for unit, scale in units:
        if abs(n) >= scale:
            return f"{n / scale:.2f}{unit}"
    return f"{n:g}"


def human_count(n: float) -> str:
    """Parameter-style counts: 3.58B, 31.58B (B for billions, as model cards write them)."""
    return _scaled(n, (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)))


def human_flops(n: float) -> str:
    """FLOPs with SI prefixes: 22.28 GFLOP, 5.20e+23 = 520.20 ZFLOP."""
    units = (("Y", 1e24), ("Z", 1e21), ("E", 1e18), ("P", 1e15), ("T", 1e12), ("G", 1e9))
    return _scaled(n, tuple((f" {u}FLOP", s) for u, s in units)) if n else "0"


def human_bytes(n: float) -> str:
    """Bytes in binary units: 1.50 GiB; below a KiB, whole bytes (512 B)."""
    units = ((" TiB", 2**40), (" GiB", 2**30), (" MiB", 2**20), (" KiB", 2**10))
    return _scaled(n, units) if abs(n) >= 2**10 else f"{n:.0f} B"


def human_duration(seconds: float) -> str:
    """Seconds as the largest unit that keeps the number at least 1: 1.88 min, 500.64 days."""
    if seconds < 60:
        return f"{seconds:.2f} s"
    return _scaled(seconds, ((" days", 86400.0), (" h", 3600.0), (" min", 60.0)))


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
