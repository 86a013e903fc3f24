"""The two roundings the CPU proxy's shrink rules use (``factory.proxy`` states the rules)."""

from __future__ import annotations

import math

__all__ = ["half_up", "nearest_multiple"]


def half_up(x: float) -> int:
    return math.floor(x + 0.5)


def nearest_multiple(x: float, multiple: int) -> int:
    """The positive multiple of ``multiple`` nearest ``x`` (ties up)."""
    return max(multiple, multiple * half_up(x / multiple))
