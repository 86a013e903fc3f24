"""The layer stack as SVG: one cell per layer coloured by type, a strip below it coloured by
the formats of the layer's GEMMs (shares of its FLOPs), and the pipeline cuts beneath.

Layers are drawn in stack order. Megatron gives virtual chunk ``v`` of pipeline rank ``r``
segment ``v * pp + r`` of the stack, so with interleaving a rank's chunks are apart.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import factory.layers  # noqa: F401  (registers the built-in layer types the picture names)
from factory.report.html_parts import escape, legend_key, svg
from factory.schemas.precision_recipes import PRECISION_RECIPES
from factory.spec.layer_type import LAYER_TYPES, layer_type_named

__all__ = ["Segment", "layer_stack_svg", "precision_colour", "segments", "type_colour"]

TYPE_PALETTE = ("#4c78a8", "#f58518", "#54a24b", "#b279a2", "#e45756", "#72b7b2", "#eeca3b")
"""Layer types take these colours in registration order (M, *, -, E, then any added)."""
OTHER_COLOUR = "#555555"
WIDTH = 1120
"""Pixels the cells may use: the page is 1200 px wide at most."""
TYPE_ROW, PRECISION_ROW, TOP = 24, 10, 16
_MTP_NAME = re.compile(r"^mtp\.layers\.(\d+)\.")


@dataclass(frozen=True)
class Segment:
    """A contiguous run of the stack that one pipeline rank's virtual chunk holds."""

    rank: int
    chunk: int
    start: int
    pattern: str


def segments(stage_patterns: list[list[str]]) -> list[Segment]:
    """The stack's segments in layer order (chunk-major, as Megatron interleaves them)."""
    chunks = max((len(stages) for stages in stage_patterns), default=0)
    out, start = [], 0
    for chunk in range(chunks):
        for rank, stages in enumerate(stage_patterns):
            if chunk < len(stages):
                out.append(Segment(rank, chunk, start, stages[chunk]))
                start += len(stages[chunk])
    return out


def precision_colour(recipe: str) -> str:
    """The colour a recipe declares; a name no recipe has (a page of an older plan) is grey."""
    registered = PRECISION_RECIPES.get(recipe)
    return OTHER_COLOUR if registered is None else registered.colour


def _modules_by_cell(modules: list[dict[str, Any]]) -> dict[tuple[str, int], list[dict[str, Any]]]:
    """Precision rows keyed ('main', layer) or ('mtp', depth)."""
    cells: dict[tuple[str, int], list[dict[str, Any]]] = defaultdict(list)
    for row in modules:
        if isinstance(row.get("layer"), int):
            cells[("main", row["layer"])].append(row)
        elif match := _MTP_NAME.match(str(row.get("name", ""))):
            cells[("mtp", int(match.group(1)))].append(row)
    return cells


def _short(name: str) -> str:
    """'backbone.layers.3.mixer.in_proj' -> 'mixer.in_proj'."""
    return re.sub(r"^(backbone|mtp)\.layers\.\d+\.", "", name)


def _precision_cell(
    x: float, y: float, width: float, rows: list[dict[str, Any]], title: str
) -> str:
    flops: dict[str, float] = defaultdict(float)
    for row in rows:
        flops[str(row.get("recipe"))] += max(float(row.get("flops_per_token") or 0), 1.0)
    total = sum(flops.values())
    lines = [f"{_short(r['name'])}: {r['recipe']} ({r.get('reason', '')})" for r in rows]
    parts = [f"<g><title>{escape(title + chr(10) + chr(10).join(lines))}</title>"]
    offset = x
    for recipe in sorted(flops, key=lambda r: -flops[r]):
        w = width * flops[recipe] / total
        parts.append(
            f'<rect x="{offset:.2f}" y="{y}" width="{w:.2f}" height="{PRECISION_ROW}" '
            f'fill="{precision_colour(recipe)}"/>'
        )
        offset += w
    return "".join(parts) + "</g>"


def _type_colour(symbol: str) -> str:
    symbols = list(LAYER_TYPES)
    index = symbols.index(symbol) if symbol in symbols else len(TYPE_PALETTE)
    return TYPE_PALETTE[index] if index < len(TYPE_PALETTE) else OTHER_COLOUR


def type_colour(name: str) -> str | None:
    """The colour of the layer type named ``name`` ('mamba', 'moe'...), as the stack draws
    it; None for a name that is no layer type."""
    try:
        return _type_colour(layer_type_named(name).symbol)
    except KeyError:
        return None


def _type_title(symbol: str) -> str:
    kind = LAYER_TYPES.get(symbol)
    return symbol if kind is None else kind.title or kind.name


def _cell(x: float, y: float, size: float, symbol: str, title: str) -> str:
    colour = _type_colour(symbol)
    return (
        f'<rect class="layer-cell" x="{x:.2f}" y="{y}" width="{size:.2f}" height="{TYPE_ROW}" '
        f'fill="{colour}"><title>{escape(title)}</title></rect>'
    )


def _bracket(x0: float, x1: float, y: int, label: str, colour: str = "#24292f") -> str:
    middle = (x0 + x1) / 2
    return (
        f'<path d="M{x0 + 1:.1f} {y} v4 H{x1 - 1:.1f} v-4" fill="none" stroke="{colour}"/>'
        f'<text x="{middle:.1f}" y="{y + 16}" font-size="11" text-anchor="middle" '
        f'fill="{colour}">{escape(label)}</text>'
    )


def _cut(x: float, bottom: int) -> str:
    """A pipeline cut: a black line through the rows, between two segments."""
    return (
        f'<line class="cut" x1="{x:.1f}" y1="{TOP - 2}" x2="{x:.1f}" y2="{bottom}" '
        'stroke="#24292f" stroke-width="2"/>'
    )


def _legend(y: int, recipes: list[str]) -> str:
    items = [(_type_colour(s), f"{s}  {_type_title(s)}") for s in LAYER_TYPES]
    items += [(precision_colour(r), r.upper()) for r in recipes]
    parts, x = [], 0
    for i, (colour, label) in enumerate(items):
        if i == len(LAYER_TYPES) and recipes:
            parts.append(f'<text x="{x + 10}" y="{y + 11}" font-size="11">GEMM formats:</text>')
            x += 96
        parts.append(legend_key(x, y, colour, label))
        x += 30 + 7 * len(label)
    return "".join(parts)


def layer_stack_svg(
    stage_patterns: list[list[str]], mtp_pattern: str, modules: list[dict[str, Any]] | None
) -> str:
    """The picture; ``modules`` are precision.json's rows (None: no precision strip)."""
    stack = segments(stage_patterns)
    count = sum(len(s.pattern) for s in stack)
    gap_cells = 2 if mtp_pattern else 0
    pitch = max(5.0, min(20.0, WIDTH / max(count + gap_cells + len(mtp_pattern), 1)))
    size = pitch - (2 if pitch >= 10 else 1)
    by_cell = _modules_by_cell(modules or [])
    strip = TOP + TYPE_ROW + 3
    below = strip + (PRECISION_ROW + 6 if modules is not None else 2)
    parts: list[str] = []
    label_every = 10 if pitch >= 8 else 20
    for seg in stack:
        where = f"PP rank {seg.rank}" + (
            f", virtual chunk {seg.chunk}" if len(stage_patterns[0]) > 1 else ""
        )
        for j, symbol in enumerate(seg.pattern):
            index, x = seg.start + j, (seg.start + j) * pitch
            title = f"layer {index}: {_type_title(symbol)} · {where}"
            parts.append(_cell(x, TOP, size, symbol, title))
            if modules is not None and ("main", index) in by_cell:
                parts.append(_precision_cell(x, strip, size, by_cell[("main", index)], title))
            if index % label_every == 0:
                parts.append(
                    f'<text x="{x:.1f}" y="{TOP - 4}" font-size="10" fill="#57606a">{index}</text>'
                )
        x0, x1 = seg.start * pitch, (seg.start + len(seg.pattern)) * pitch
        label = f"PP{seg.rank}" + (f"·v{seg.chunk}" if len(stage_patterns[0]) > 1 else "")
        parts.append(_bracket(x0, x1 - (pitch - size), below, label))
        if seg.start:
            parts.append(_cut(x0 - (pitch - size) / 2, below + 6))
    if mtp_pattern:
        start = (count + gap_cells) * pitch
        for k, symbol in enumerate(mtp_pattern):
            x = start + k * pitch
            title = f"MTP block {k}: {_type_title(symbol)} · last PP rank"
            parts.append(_cell(x, TOP, size, symbol, title))
            if modules is not None and ("mtp", k) in by_cell:
                parts.append(_precision_cell(x, strip, size, by_cell[("mtp", k)], title))
        parts.append(
            _bracket(start, start + len(mtp_pattern) * pitch - (pitch - size), below, "MTP")
        )
    recipes = sorted({str(m.get("recipe")) for m in modules or []}, key=_recipe_order)
    legend_y = below + 30
    width = max((count + gap_cells + len(mtp_pattern)) * pitch, 760)
    height = legend_y + 20
    return svg("layer-stack", width, height, "".join(parts) + _legend(legend_y, recipes))


def _recipe_order(recipe: str) -> tuple[int, str]:
    """Registration order, then the names no recipe has."""
    order = list(PRECISION_RECIPES)
    return (order.index(recipe) if recipe in PRECISION_RECIPES else len(order), recipe)
