"""The build report as a self-contained HTML page with SVG pictures.

Two pictures say what tables cannot: the layer pattern as a strip (one cell
per layer, coloured by type, one row per pipeline rank and virtual stage), and
the peak rank's memory as a stacked bar against the GPU's capacity.
"""

from __future__ import annotations

import html
from typing import Any

from factory.planner.report import human_bytes, sections

__all__ = ["html_report"]

COLOURS = {"M": "#4c78a8", "*": "#f58518", "-": "#54a24b", "E": "#b279a2"}
NAMES = {"M": "Mamba-2", "*": "attention", "-": "MLP", "E": "MoE"}
CELL, GAP = 12, 2


def _pattern_svg(stage_patterns: list[list[str]], mtp: str) -> str:
    rows = [
        (f"rank {r} / stage {v}", seg)
        for r, stages in enumerate(stage_patterns)
        for v, seg in enumerate(stages)
    ]
    if mtp:
        rows.append(("MTP (last rank)", mtp))
    width = 130 + max(len(seg) for _, seg in rows) * (CELL + GAP)
    height = len(rows) * (CELL + 8) + 30
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}">']
    for i, (label, seg) in enumerate(rows):
        y = i * (CELL + 8)
        parts.append(f'<text x="0" y="{y + CELL - 2}" font-size="11">{html.escape(label)}</text>')
        for j, symbol in enumerate(seg):
            x = 130 + j * (CELL + GAP)
            parts.append(
                f'<rect x="{x}" y="{y}" width="{CELL}" height="{CELL}" fill="{COLOURS[symbol]}">'
                f"<title>layer {j}: {NAMES[symbol]}</title></rect>"
            )
    legend_y = len(rows) * (CELL + 8) + 12
    for k, (symbol, name) in enumerate(NAMES.items()):
        x = 130 + k * 110
        parts.append(
            f'<rect x="{x}" y="{legend_y}" width="{CELL}" height="{CELL}" '
            f'fill="{COLOURS[symbol]}"/>'
        )
        parts.append(
            f'<text x="{x + CELL + 4}" y="{legend_y + CELL - 2}" font-size="11">'
            f"{symbol} {name}</text>"
        )
    parts.append("</svg>")
    return "".join(parts)


def _memory_svg(memory: dict[str, Any], capacity: int) -> str:
    pieces = [
        ("weights", memory["weights"], "#4c78a8"),
        ("gradients", memory["gradients"], "#72b7b2"),
        (
            "optimizer",
            memory["total"]
            - memory["weights"]
            - memory["gradients"]
            - memory["activations"]["total"],
            "#54a24b",
        ),
        ("activations", memory["activations"]["total"], "#f58518"),
    ]
    scale = 600 / max(capacity, memory["total"])
    parts = ['<svg xmlns="http://www.w3.org/2000/svg" width="720" height="80">']
    x = 0.0
    for label, size, colour in pieces:
        w = size * scale
        parts.append(
            f'<rect x="{x:.1f}" y="10" width="{w:.1f}" height="28" fill="{colour}">'
            f"<title>{label}: {human_bytes(size)}</title></rect>"
        )
        x += w
    cap = capacity * scale
    parts.append(
        f'<line x1="{cap:.1f}" y1="4" x2="{cap:.1f}" y2="44" stroke="#d62728" stroke-width="2"/>'
    )
    parts.append(
        f'<text x="{min(cap, 560):.1f}" y="58" font-size="11" fill="#d62728">'
        f"GPU memory {human_bytes(capacity)}</text>"
    )
    legend = " · ".join(f"{label} {human_bytes(size)}" for label, size, _ in pieces)
    parts.append(f'<text x="0" y="74" font-size="11">{html.escape(legend)}</text></svg>')
    return "".join(parts)


def html_report(plan: dict[str, Any], title: str, mtp_pattern: str, capacity: int) -> str:
    """A standalone page: the two pictures, then the same tables as report.md."""
    layout = plan["layout"]
    peak = plan["memory_per_rank_bytes"]["peak_rank"]
    body = []
    for section, rows in sections(plan):
        cells = "".join(
            "<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows
        )
        body.append(f"<h2>{html.escape(section)}</h2><table>{cells}</table>")
    return (
        "<!doctype html><html><head><meta charset='utf-8'>"
        f"<title>{html.escape(title)}</title><style>"
        "body{font-family:sans-serif;margin:2em;max-width:1100px}"
        "td{padding:2px 10px;border-bottom:1px solid #eee}td:nth-child(2){text-align:right}"
        "</style></head><body>"
        f"<h1>{html.escape(title)}</h1>"
        "<h2>Layers by pipeline rank</h2>"
        + _pattern_svg(layout["stage_patterns"], mtp_pattern)
        + f"<h2>Memory of the peak rank (pipeline rank {peak})</h2>"
        + _memory_svg(plan["memory_per_rank_bytes"], capacity)
        + "".join(body)
        + "</body></html>\n"
    )
