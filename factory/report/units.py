"""Numbers for people: counts, FLOPs, bytes, durations, energy and shares with their units,
thousands separators, and never an exponent. Every report, the terminal's plan included,
formats numbers here."""

from __future__ import annotations

import math

__all__ = [
    "format_number", "human_bytes", "human_count", "human_duration", "human_energy",
    "human_flops", "human_gpu_hours", "percent", "plain",
]  # fmt: skip

SMALLEST = 1e-12
"""Below this a plain decimal would be a wall of zeros: such a value prints as '≈ 0' (nothing
this module formats means anything that small)."""


def _trim(text: str) -> str:
    """'10.00' -> '10', '1.50' -> '1.5': trailing zeros of a fixed-point number add nothing."""
    return text.rstrip("0").rstrip(".") if "." in text else text


def plain(value: float, digits: int = 3) -> str:
    """``value`` with about ``digits`` significant digits as a plain decimal: 0.0000197, 2.62,
    50,677; never '1.97e-05'."""
    if not math.isfinite(value):
        return str(value)
    size = abs(value)
    if size == 0:
        return "0"
    if size < SMALLEST:
        return "≈ 0"
    decimals = max(0, digits - 1 - math.floor(math.log10(size)))
    return _trim(f"{value:,.{decimals}f}")


def format_number(value: float) -> str:
    """Integers (and whole floats) with thousands separators; other numbers with about four
    significant digits, whole from 1,000 up."""
    if isinstance(value, int) or (math.isfinite(value) and float(value).is_integer()):
        return f"{int(value):,}"
    return plain(value, 4) if abs(value) < 1000 else f"{value:,.0f}"


def _scaled(n: float, units: tuple[tuple[str, float], ...], below: str = "") -> str:
    for unit, scale in units:
        if abs(n) >= scale:
            return f"{n / scale:,.2f}{unit}"
    return plain(n) + below


def human_count(n: float) -> str:
    """Parameter-style counts: 3.58B, 31.58B (B for billions, as model cards write them); below
    a thousand, the number itself."""
    return _scaled(n, (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)))


def human_flops(n: float) -> str:
    """FLOPs with SI prefixes: 38.95 MFLOP, 22.28 GFLOP, 520.20 ZFLOP."""
    units = (("Y", 1e24), ("Z", 1e21), ("E", 1e18), ("P", 1e15), ("T", 1e12), ("G", 1e9),
             ("M", 1e6), ("K", 1e3))  # fmt: skip
    return _scaled(n, tuple((f" {u}FLOP", s) for u, s in units), " FLOP")


def human_bytes(n: float) -> str:
    """Bytes in binary units: 1.50 GiB; below a KiB, whole bytes (512 B)."""
    units = ((" TiB", 2**40), (" GiB", 2**30), (" MiB", 2**20), (" KiB", 2**10))
    return _scaled(n, units) if abs(n) >= 2**10 else f"{n:.0f} B"


def human_duration(seconds: float) -> str:
    """The largest unit that keeps the number at least 1: 58 ms, 2.62 s, 10 min, 9.99 h,
    2,111.54 days."""
    if abs(seconds) < 1:
        return f"{plain(seconds * 1000)} ms" if seconds else "0 s"
    for unit, scale in ((" days", 86400.0), (" h", 3600.0), (" min", 60.0), (" s", 1.0)):
        if abs(seconds) >= scale:
            return f"{seconds / scale:,.2f}".removesuffix(".00") + unit
    raise AssertionError("unreachable: |seconds| >= 1")


def human_energy(mwh: float) -> str:
    """Energy from MWh in the unit that keeps the number at least 1: 269.1 MWh, 3.2 kWh, 11 Wh."""
    if abs(mwh) >= 1:
        return f"{mwh:,.1f} MWh"
    if abs(mwh) >= 1e-3:
        return f"{plain(mwh * 1e3)} kWh"
    return f"{plain(mwh * 1e6)} Wh"


def human_gpu_hours(hours: float) -> str:
    """384,490 GPU-hours; under one, the GPU time as a duration (58 ms of GPU time)."""
    if abs(hours) < 1:
        return f"{human_duration(hours * 3600)} of GPU time"
    whole = math.isfinite(hours) and abs(hours) >= 100  # a fraction of an hour adds nothing there
    return f"{format_number(round(hours) if whole else hours)} GPU-hours"


def percent(fraction: float) -> str:
    """A share as a percentage, one decimal from 10% up and three significant digits below (a
    column of them lines up): 38.0%, 12.5%, 0.637%, 0.0400%, 4.00%; under 0.001%, '< 0.001%'."""
    value = fraction * 100
    if value == 0:
        return "0%"
    if abs(value) < 1e-3:
        return "< 0.001%"
    if abs(value) >= 10:
        return f"{value:,.1f}%"
    decimals = max(0, 2 - math.floor(math.log10(abs(value))))  # three significant digits
    return f"{value:.{decimals}f}%"
