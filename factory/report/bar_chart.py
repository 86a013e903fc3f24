"""Horizontal bar charts as SVG: one group of bars per category, one bar per series."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from factory.report.html_parts import escape, legend_key, svg

__all__ = ["Series", "bar_chart_svg"]

LABEL, PLOT, VALUE_ROOM, BAR, GROUP_GAP = 170, 620, 200, 14, 10


@dataclass(frozen=True)
class Series:
    name: str
    colour: str
    values: Sequence[float]


def _bar(y: float, width: float, colour: str, title: str) -> str:
    return (
        f'<rect x="{LABEL}" y="{y:.1f}" width="{max(width, 0.5):.1f}" height="{BAR}" '
        f'fill="{colour}"><title>{escape(title)}</title></rect>'
    )


def _legend(series: Sequence[Series], y: float) -> str:
    parts, x = [], LABEL
    for s in series:
        parts.append(legend_key(x, y, s.colour, s.name))
        x += 40 + 7 * len(s.name)
    return "".join(parts)


def bar_chart_svg(
    categories: Sequence[str], series: Sequence[Series], fmt: Callable[[float], str]
) -> str:
    """Bars scaled to the largest value, each labelled with ``fmt(value)``; a legend below
    when there is more than one series."""
    top = max((v for s in series for v in s.values), default=0.0) or 1.0
    group = len(series) * (BAR + 2) + GROUP_GAP
    parts = []
    for i, category in enumerate(categories):
        y0 = 4 + i * group
        middle = y0 + (group - GROUP_GAP) / 2 + 4
        parts.append(
            f'<text x="{LABEL - 8}" y="{middle:.1f}" font-size="12" text-anchor="end">'
            f"{escape(category)}</text>"
        )
        for k, s in enumerate(series):
            y = y0 + k * (BAR + 2)
            width = PLOT * s.values[i] / top
            parts.append(_bar(y, width, s.colour, f"{category}, {s.name}: {fmt(s.values[i])}"))
            parts.append(
                f'<text x="{LABEL + width + 5:.1f}" y="{y + BAR - 3:.1f}" font-size="11" '
                f'fill="#57606a">{escape(fmt(s.values[i]))}</text>'
            )
    height = 4 + len(categories) * group
    if len(series) > 1:
        parts.append(_legend(series, height + 2))
        height += 22
    width = LABEL + PLOT + VALUE_ROOM
    return svg("bars", width, height, "".join(parts))
