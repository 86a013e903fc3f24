"""Memory per pipeline rank as SVG: a stacked bar per rank, by component, against the GPU."""

from __future__ import annotations

from typing import Any

from factory.report.html_parts import escape, legend_key, svg
from factory.report.units import human_bytes

__all__ = ["COMPONENT_COLOURS", "memory_components", "memory_svg"]

COMPONENT_COLOURS = {
    "weights": "#4c78a8",
    "gradients": "#72b7b2",
    "optimizer": "#54a24b",
    "activations": "#f58518",
}
LABEL, BAR_WIDTH, ROW, BAR = 70, 820, 30, 20


def memory_components(rank: dict[str, Any]) -> dict[str, float]:
    """Bytes by component; the optimizer is what the total leaves (the plan's own split:
    distributed optimizer or not)."""
    weights, gradients = float(rank["weights"]), float(rank["gradients"])
    activations = float(rank["activations"]["total"])
    optimizer = float(rank["total"]) - weights - gradients - activations
    return {
        "weights": weights,
        "gradients": gradients,
        "optimizer": optimizer,
        "activations": activations,
    }


def _row(y: int, rank: dict[str, Any], scale: float, capacity: int) -> str:
    parts, x = [], float(LABEL)
    label = f"PP rank {rank.get('pp_rank', '?')}"
    parts.append(f'<text x="0" y="{y + BAR - 6}" font-size="12">{escape(label)}</text>')
    for name, size in memory_components(rank).items():
        w = max(size, 0.0) * scale
        parts.append(
            f'<rect x="{x:.1f}" y="{y}" width="{w:.1f}" height="{BAR}" '
            f'fill="{COMPONENT_COLOURS[name]}"><title>{escape(label)} {name}: '
            f"{human_bytes(size)}</title></rect>"
        )
        x += w
    total = float(rank["total"])
    share = f" ({total / capacity:.0%} of the GPU)" if capacity else ""
    colour = "#cf222e" if capacity and total > capacity else "#24292f"
    parts.append(
        f'<text x="{x + 6:.1f}" y="{y + BAR - 6}" font-size="11" fill="{colour}">'
        f"{escape(human_bytes(total) + share)}</text>"
    )
    return "".join(parts)


def memory_svg(per_rank: list[dict[str, Any]], capacity: int, gpu: str) -> str:
    """One bar per pipeline rank; a red line at the GPU's memory (``capacity`` bytes)."""
    peak = max((float(r["total"]) for r in per_rank), default=1.0)
    scale = BAR_WIDTH * 0.82 / max(peak, capacity, 1)
    rows = "".join(_row(8 + i * ROW, rank, scale, capacity) for i, rank in enumerate(per_rank))
    bottom = 8 + len(per_rank) * ROW
    parts = [rows]
    if capacity:
        cap = LABEL + capacity * scale
        parts.append(
            f'<line x1="{cap:.1f}" y1="2" x2="{cap:.1f}" y2="{bottom}" stroke="#d62728" '
            f'stroke-width="2" stroke-dasharray="5 3"/><text x="{cap - 4:.1f}" y="{bottom + 13}" '
            f'font-size="11" fill="#d62728" text-anchor="end">'
            f"{escape(gpu.upper())} memory {escape(human_bytes(capacity))}</text>"
        )
    x = LABEL
    for name, colour in COMPONENT_COLOURS.items():
        parts.append(legend_key(x, bottom + 24, colour, name))
        x += 40 + 7 * len(name)
    height = bottom + 46
    width = LABEL + BAR_WIDTH + 140
    return svg("memory", width, height, "".join(parts))
