"""A training program on one timeline, as SVG: the stages as bands along x (tokens or steps
across the whole program), with tracks for the learning rate, the sequence length, the
layout and, for a run, the loss; and each stage's data mixture as a stacked bar.

Stages differ in size by orders of magnitude (Nano's long-context stage is 0.5% of its
tokens), so the tracks' bands have a minimum width to stay legible, and a thin strip on
top draws the stages exactly to scale. Every number comes from the caller: the planned
program (``program_plan.json``) or a run's metrics.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from factory.report.html_parts import escape, legend_key, svg

__all__ = ["Band", "band_widths", "mixture_svg", "timeline_svg"]

WIDTH, LEFT, RIGHT = 1100, 118, 16
PLOT = WIDTH - LEFT - RIGHT
MIN_BAND = 132
"""The narrowest a stage's band is drawn in the tracks (its name and layout fit)."""
SCALE_Y, SCALE_H = 6, 10
HEAD_Y = 30
LR_Y, LR_H = 80, 80
SEQ_Y, SEQ_H = 196, 36
LAYOUT_Y = 252
LOSS_Y, LOSS_H = 306, 84
BAND_FILLS = ("#f3f6fa", "#fbfbfd")
STAGE_COLOURS = ("#4c78a8", "#f58518", "#54a24b", "#b279a2", "#e45756", "#72b7b2", "#9d755d")
LR_COLOUR, SEQ_COLOUR, LOSS_COLOUR, FAIL_COLOUR = "#0969da", "#8250df", "#1a7f37", "#cf222e"
CATEGORY_PALETTE = (
    "#4c78a8", "#f58518", "#54a24b", "#e45756", "#72b7b2", "#eeca3b", "#b279a2", "#ff9da6",
    "#9d755d", "#bab0ac", "#1f77b4", "#aec7e8", "#98df8a", "#c5b0d5", "#c49c94", "#dbdb8d",
)  # fmt: skip


@dataclass(frozen=True)
class Band:
    """One stage on the timeline."""

    name: str
    amount: float
    """Its length along x: tokens (the planned program) or steps (a run)."""
    amount_label: str
    """Under the stage's name; each part separated by " · " on a line of its own."""
    lr: Sequence[tuple[float, float]]
    """(position within the stage, 0 to 1; learning rate)."""
    seq_len: int
    layout: tuple[str, str]
    """Two short lines: the parallel degrees, and the GPUs and batch."""
    loss: Sequence[tuple[float, float]] = ()
    """(position within the stage, 0 to 1; LM loss), for a run."""
    verdict: str = ""
    passed: bool | None = None
    details: str = ""
    """The band's hover text."""


def stage_colour(index: int) -> str:
    return STAGE_COLOURS[index % len(STAGE_COLOURS)]


def band_widths(
    amounts: Sequence[float], width: float = PLOT, least: float = MIN_BAND
) -> list[float]:
    """Widths summing to ``width``, proportional to ``amounts`` except that none is below
    ``least``: the stages drawn at ``least`` take it, the rest share what is left in
    proportion (equal widths when ``least`` does not fit every stage)."""
    count = len(amounts)
    if not count:
        return []
    if least * count >= width or sum(amounts) <= 0:
        return [width / count] * count
    pinned: set[int] = set()
    while True:
        free = [i for i in range(count) if i not in pinned]
        room = width - least * len(pinned)
        total = sum(amounts[i] for i in free)
        widths = [least if i in pinned else room * amounts[i] / total for i in range(count)]
        small = {i for i in free if widths[i] < least}
        if not small:
            return widths
        pinned |= small


def _edges(widths: Sequence[float]) -> list[float]:
    edges = [float(LEFT)]
    for width in widths:
        edges.append(edges[-1] + width)
    return edges


def _scale_strip(bands: Sequence[Band]) -> str:
    """The stages exactly to scale: the one place x is proportional without a minimum."""
    total = sum(b.amount for b in bands) or 1.0
    parts, x = [], float(LEFT)
    parts.append(
        f'<text x="{LEFT - 8}" y="{SCALE_Y + 9}" font-size="10" text-anchor="end" '
        f'fill="#57606a">to scale</text>'
    )
    for i, band in enumerate(bands):
        width = PLOT * band.amount / total
        parts.append(
            f'<rect class="scale" data-stage="{escape(band.name)}" x="{x:.3f}" y="{SCALE_Y}" '
            f'width="{width:.3f}" height="{SCALE_H}" fill="{stage_colour(i)}">'
            f"<title>{escape(band.name)}: {escape(band.amount_label)} "
            f"({band.amount / total:.2%} of the program)</title></rect>"
        )
        x += width
    return "".join(parts)


def _polyline(points: Sequence[tuple[float, float]], colour: str, width: float = 1.6) -> str:
    if not points:
        return ""
    if len(points) == 1:
        x, y = points[0]
        return f'<circle cx="{x:.1f}" cy="{y:.1f}" r="2" fill="{colour}"/>'
    coords = " ".join(f"{x:.1f},{y:.1f}" for x, y in points)
    return f'<polyline points="{coords}" fill="none" stroke="{colour}" stroke-width="{width}"/>'


def _track_label(y: float, height: float, text: str, top: str, bottom: str) -> str:
    mid = y + height / 2
    return (
        f'<text x="{LEFT - 8}" y="{mid + 4:.0f}" font-size="11" font-weight="600" '
        f'text-anchor="end">{escape(text)}</text>'
        f'<text x="{LEFT - 8}" y="{y + 9:.0f}" font-size="9" text-anchor="end" '
        f'fill="#57606a">{escape(top)}</text>'
        f'<text x="{LEFT - 8}" y="{y + height:.0f}" font-size="9" text-anchor="end" '
        f'fill="#57606a">{escape(bottom)}</text>'
    )


def _fmt_rate(rate: float) -> str:
    return f"{rate:.1e}".replace("e-0", "e-").replace("e+0", "e")


def _lr_track(bands: Sequence[Band], edges: Sequence[float]) -> str:
    """On a log scale: a program's rates span decades (pretraining's 1e-3, a long-context
    stage's 1e-5, a warmup's first steps below that), and each must be seen."""
    rates = [rate for b in bands for _, rate in b.lr if rate > 0]
    high = math.log10(max(rates, default=1.0))
    low = math.log10(min(rates, default=1.0))
    span = (high - low) or 1.0

    def y(rate: float) -> float:
        return LR_Y + LR_H * (1 - (math.log10(rate) - low) / span) if rate > 0 else LR_Y + LR_H

    parts = [_track_label(LR_Y, LR_H, "LR (log)", _fmt_rate(10**high), _fmt_rate(10**low))]
    for i, band in enumerate(bands):
        left, right = edges[i] + 3, edges[i + 1] - 3
        parts.append(_polyline([(left + f * (right - left), y(rate)) for f, rate in band.lr],
                               LR_COLOUR))  # fmt: skip
        if band.lr:
            first, last = band.lr[0][1], band.lr[-1][1]
            parts.append(
                f'<text x="{left + 2:.1f}" y="{LR_Y + LR_H + 12}" font-size="9" fill="{LR_COLOUR}">'
                f"{escape(_fmt_rate(first))} → {escape(_fmt_rate(last))}</text>"
            )
    return "".join(parts)


def _seq_track(bands: Sequence[Band], edges: Sequence[float]) -> str:
    lengths = [b.seq_len for b in bands]
    low, high = math.log2(min(lengths)), math.log2(max(lengths))
    span = (high - low) or 1.0
    parts = [_track_label(SEQ_Y, SEQ_H, "seq len", f"{max(lengths):,}", f"{min(lengths):,}")]
    for i, band in enumerate(bands):
        left, right = edges[i] + 3, edges[i + 1] - 3
        y = SEQ_Y + SEQ_H * (1 - (math.log2(band.seq_len) - low) / span)
        parts.append(
            f'<line x1="{left:.1f}" x2="{right:.1f}" y1="{y:.1f}" y2="{y:.1f}" '
            f'stroke="{SEQ_COLOUR}" stroke-width="3"/>'
            f'<text x="{left + 2:.1f}" y="{y - 4:.1f}" font-size="10" fill="{SEQ_COLOUR}">'
            f"{band.seq_len:,}</text>"
        )
    return "".join(parts)


def _layout_track(bands: Sequence[Band], edges: Sequence[float]) -> str:
    parts = [
        f'<text x="{LEFT - 8}" y="{LAYOUT_Y + 16}" font-size="11" font-weight="600" '
        f'text-anchor="end">layout</text>'
    ]
    for i, band in enumerate(bands):
        x = edges[i] + 5
        first, second = band.layout
        parts.append(
            f'<text x="{x:.1f}" y="{LAYOUT_Y + 10}" font-size="10">{escape(first)}</text>'
            f'<text x="{x:.1f}" y="{LAYOUT_Y + 24}" font-size="10" fill="#57606a">'
            f"{escape(second)}</text>"
        )
    return "".join(parts)


def _loss_track(bands: Sequence[Band], edges: Sequence[float]) -> str:
    losses = [loss for b in bands for _, loss in b.loss]
    low, high = min(losses), max(losses)
    span = (high - low) or 1.0
    parts = [_track_label(LOSS_Y, LOSS_H, "LM loss", f"{high:.2f}", f"{low:.2f}")]
    for i, band in enumerate(bands):
        left, right = edges[i] + 3, edges[i + 1] - 3
        points = [
            (left + f * (right - left), LOSS_Y + LOSS_H * (1 - (loss - low) / span))
            for f, loss in band.loss
        ]
        parts.append(_polyline(points, LOSS_COLOUR))
        if band.passed is not None:
            passed = band.passed
            mark, colour = ("✓ passed", LOSS_COLOUR) if passed else ("✗ failed", FAIL_COLOUR)
            parts.append(
                f'<text x="{left + 2:.1f}" y="{LOSS_Y + LOSS_H + 13}" font-size="10" '
                f'font-weight="600" fill="{colour}">{mark}<title>{escape(band.verdict)}</title>'
                "</text>"
            )
    return "".join(parts)


def _axis(
    bands: Sequence[Band], edges: Sequence[float], y: float, unit: str, fmt: Callable[[float], str]
) -> str:
    """Cumulative amounts at the stage boundaries (the bands are not to scale: ticks are)."""
    parts = [f'<line x1="{LEFT}" x2="{LEFT + PLOT}" y1="{y}" y2="{y}" stroke="#8c959f"/>']
    done = 0.0
    for i, edge in enumerate(edges):
        anchor = "start" if i == 0 else "end" if i == len(edges) - 1 else "middle"
        parts.append(
            f'<line x1="{edge:.1f}" x2="{edge:.1f}" y1="{y}" y2="{y + 4}" stroke="#8c959f"/>'
            f'<text x="{edge:.1f}" y="{y + 15}" font-size="9" text-anchor="{anchor}" '
            f'fill="#57606a">{escape(fmt(done))}</text>'
        )
        if i < len(bands):
            done += bands[i].amount
    parts.append(
        f'<text x="{LEFT - 8}" y="{y + 15}" font-size="10" text-anchor="end" '
        f'fill="#57606a">{escape(unit)}</text>'
    )
    return "".join(parts)


def timeline_svg(
    bands: Sequence[Band], unit: str, fmt: Callable[[float], str], css: str = "timeline"
) -> str:
    """The program's stages along x, the cumulative ``unit`` (tokens, steps) at their
    boundaries written by ``fmt``; tracks for LR, sequence length, layout, and the loss
    where any band has one."""
    if not bands:
        raise ValueError("a timeline needs at least one stage")
    widths = band_widths([b.amount for b in bands])
    edges = _edges(widths)
    has_loss = any(b.loss for b in bands)
    bottom = (LOSS_Y + LOSS_H + 22) if has_loss else (LAYOUT_Y + 34)
    parts = [_scale_strip(bands)]
    for i, band in enumerate(bands):
        left = edges[i]
        parts.append(
            f'<rect class="band" data-stage="{escape(band.name)}" x="{left:.1f}" y="{HEAD_Y - 6}" '
            f'width="{widths[i]:.1f}" height="{bottom - HEAD_Y + 6:.0f}" '
            f'fill="{BAND_FILLS[i % 2]}" stroke="#d0d7de"><title>{escape(band.details)}</title>'
            f"</rect>"
            f'<rect x="{left:.1f}" y="{HEAD_Y - 6}" width="{widths[i]:.1f}" height="4" '
            f'fill="{stage_colour(i)}"/>'
            f'<text x="{left + 5:.1f}" y="{HEAD_Y + 12}" font-size="12" font-weight="700">'
            f"{escape(band.name)}</text>"
        )
        for line, text in enumerate(band.amount_label.split(" · ")):
            parts.append(
                f'<text x="{left + 5:.1f}" y="{HEAD_Y + 25 + 12 * line}" font-size="10" '
                f'fill="#57606a">{escape(text)}</text>'
            )
    parts += [_lr_track(bands, edges), _seq_track(bands, edges), _layout_track(bands, edges)]
    if has_loss:
        parts.append(_loss_track(bands, edges))
    parts.append(_axis(bands, edges, bottom + 4, unit, fmt))
    return svg(css, WIDTH, bottom + 26, "".join(parts))


ROW, BAR_H, PLANNED_H = 38, 16, 6
MIX_LABEL = 150


def _category_colours(categories: Sequence[str]) -> dict[str, str]:
    return {c: CATEGORY_PALETTE[i % len(CATEGORY_PALETTE)] for i, c in enumerate(categories)}


def _stacked(y: float, height: float, shares: dict[str, float], colours: dict[str, str],
             what: str, stage: str) -> str:  # fmt: skip
    total = sum(shares.values()) or 1.0
    plot = WIDTH - MIX_LABEL - RIGHT
    parts, x = [], float(MIX_LABEL)
    for category, value in shares.items():
        width = plot * value / total
        if width <= 0:
            continue
        parts.append(
            f'<rect class="mix" data-stage="{escape(stage)}" data-what="{what}" '
            f'data-category="{escape(category)}" x="{x:.2f}" y="{y:.1f}" width="{width:.2f}" '
            f'height="{height}" fill="{colours[category]}"><title>{escape(stage)}, '
            f"{escape(category)}: {value / total:.1%} of {what} tokens</title></rect>"
        )
        if width > 44 and height >= BAR_H:
            parts.append(
                f'<text x="{x + 3:.1f}" y="{y + 12:.1f}" font-size="9" fill="#fff">'
                f"{value / total:.0%}</text>"
            )
        x += width
    return "".join(parts)


def mixture_svg(
    stages: Sequence[tuple[str, str, dict[str, float], dict[str, float]]],
) -> str:
    """Per stage (name, caption, curated tokens by category, planned tokens by category): a
    bar of the curated shares and a thin bar of the planned ones beneath, one colour per
    category across every stage, and the legend."""
    categories = sorted({c for _, _, curated, planned in stages for c in (*curated, *planned)})
    colours = _category_colours(categories)
    parts = []
    for i, (name, caption, curated, planned) in enumerate(stages):
        y = 8 + i * ROW
        parts.append(
            f'<text x="{MIX_LABEL - 8}" y="{y + 12}" font-size="12" font-weight="700" '
            f'text-anchor="end">{escape(name)}</text>'
            f'<text x="{MIX_LABEL - 8}" y="{y + 25}" font-size="9" fill="#57606a" '
            f'text-anchor="end">{escape(caption)}</text>'
        )
        ordered = {c: curated.get(c, 0.0) for c in categories}
        parts.append(_stacked(y, BAR_H, ordered, colours, "curated", name))
        planned_ordered = {c: planned.get(c, 0.0) for c in categories}
        parts.append(_stacked(y + BAR_H + 2, PLANNED_H, planned_ordered, colours, "planned", name))
    legend_y = 8 + len(stages) * ROW + 4
    x, row = MIX_LABEL, 0
    for category in categories:
        step = 30 + 6 * len(category)
        if x + step > WIDTH - RIGHT:
            x, row = MIX_LABEL, row + 1
        parts.append(legend_key(x, legend_y + row * 20, colours[category], category))
        x += step
    height = legend_y + (row + 1) * 20 + 4
    return svg("mixture", WIDTH, height, "".join(parts))
