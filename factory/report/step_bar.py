"""One optimizer step as a stacked bar: each component's seconds side by side, as wide as
its share of the step, with a legend (the plan's predicted breakdown)."""

from __future__ import annotations

from collections.abc import Sequence

from factory.report.html_parts import escape, legend_key, svg

__all__ = ["PALETTE", "step_bar_svg"]

WIDTH, BAR, LEGEND_COLUMN, LEGEND_ROW = 800, 28, 200, 20
PALETTE = (
    "#4c78a8", "#72b7b2", "#54a24b", "#eeca3b", "#b279a2", "#ff9da6",
    "#9d755d", "#bab0ac", "#e45756", "#f58518", "#79706e", "#d67195",
)  # fmt: skip


def step_bar_svg(parts: Sequence[tuple[str, float]]) -> str:
    """``parts`` as (label, seconds); zero parts are left out."""
    shown = [(label, value) for label, value in parts if value > 0]
    total = sum(value for _, value in shown) or 1.0
    body, x = [], 0.0
    for i, (label, value) in enumerate(shown):
        width = WIDTH * value / total
        colour = PALETTE[i % len(PALETTE)]
        title = f"{label}: {value:.3f} s ({value / total:.1%})"
        body.append(
            f'<rect x="{x:.1f}" y="0" width="{max(width, 0.5):.1f}" height="{BAR}" '
            f'fill="{colour}"><title>{escape(title)}</title></rect>'
        )
        x += width
    per_row = WIDTH // LEGEND_COLUMN
    for i, (label, value) in enumerate(shown):
        column, row = i % per_row, i // per_row
        key = f"{label} {value / total:.0%}"
        y = BAR + 8 + row * LEGEND_ROW
        body.append(legend_key(column * LEGEND_COLUMN, y, PALETTE[i % len(PALETTE)], key))
    rows = -(-len(shown) // per_row)
    return svg("step", WIDTH, BAR + 12 + rows * LEGEND_ROW, "".join(body))
