"""One optimizer step as a stacked bar: each component's seconds side by side, as wide as
its share of the step, with a legend (the plan's predicted breakdown).

Colours say what a part is: a layer type's compute in the colour the layer stack gives that
type, its recompute in the same colour, paler; communication in browns and greys; the
pipeline bubble, the optimizer and the overhead each their own."""

from __future__ import annotations

from collections.abc import Sequence

from factory.report.html_parts import escape, legend_key, svg
from factory.report.layer_stack import type_colour

__all__ = ["part_colour", "step_bar_svg"]

WIDTH, BAR, LEGEND_COLUMN, LEGEND_ROW = 800, 28, 200, 20
OTHER_PARTS = {
    "compute.head": "#3b4a5a",
    "compute.mtp": "#8e6c8a",
    "pipeline_bubble": "#e45756",
    "optimizer": "#eeca3b",
    "overhead": "#9ecae9",
}
COMMUNICATION = {
    "tp": "#9d755d", "sp": "#9d755d", "ep": "#c49c94", "etp": "#c49c94", "cp": "#79706e",
    "pp": "#bab0ac", "dp": "#5c4033",
}  # fmt: skip
FALLBACK = "#888888"


def part_colour(key: str) -> tuple[str, float]:
    """(fill, opacity) of the breakdown entry ``key`` ('compute.moe', 'communication.ep',
    'recompute.attention', 'optimizer'...)."""
    group, _, what = key.partition(".")
    if key in OTHER_PARTS:
        return OTHER_PARTS[key], 1.0
    if group == "communication":
        return COMMUNICATION.get(what, FALLBACK), 1.0
    if group in ("compute", "recompute"):
        colour = type_colour(what) or OTHER_PARTS.get(f"compute.{what}", FALLBACK)
        return colour, 1.0 if group == "compute" else 0.45
    return FALLBACK, 1.0


def step_bar_svg(parts: Sequence[tuple[str, str, float]]) -> str:
    """``parts`` as (breakdown key, label, seconds); zero parts are left out."""
    shown = [(key, label, value) for key, label, value in parts if value > 0]
    total = sum(value for _, _, value in shown) or 1.0
    body, x = [], 0.0
    for key, label, value in shown:
        width = WIDTH * value / total
        colour, opacity = part_colour(key)
        title = f"{label}: {value:.3f} s ({value / total:.1%})"
        body.append(
            f'<rect x="{x:.1f}" y="0" width="{max(width, 0.5):.1f}" height="{BAR}" '
            f'fill="{colour}" fill-opacity="{opacity}"><title>{escape(title)}</title></rect>'
        )
        x += width
    per_row = WIDTH // LEGEND_COLUMN
    for i, (key, label, value) in enumerate(shown):
        column, row = i % per_row, i // per_row
        y = BAR + 8 + row * LEGEND_ROW
        colour, opacity = part_colour(key)
        shade = colour if opacity == 1.0 else _paler(colour, opacity)
        body.append(legend_key(column * LEGEND_COLUMN, y, shade, f"{label} {value / total:.0%}"))
    rows = -(-len(shown) // per_row)
    return svg("step", WIDTH, BAR + 12 + rows * LEGEND_ROW, "".join(body))


def _paler(colour: str, opacity: float) -> str:
    """``colour`` at ``opacity`` over white, as one opaque colour (for the legend's key)."""
    rgb = [int(colour[i : i + 2], 16) for i in (1, 3, 5)]
    mixed = [round(255 - (255 - c) * opacity) for c in rgb]
    return "#" + "".join(f"{c:02x}" for c in mixed)
