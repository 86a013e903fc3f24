"""The PNG plots of training runs: a run's loss, learning rate, gradient norm and per-layer
monitors (the run page shows them all, the build page the loss and the monitors), and the
build's distributed check, its losses over the smoke run's.

Every plot of a run has the optimizer update on its x axis, which keeps counting across
rollbacks, and marks what the run's monitors did on it the same way (see
:data:`MARKS`). Drawn on the Agg canvas directly: no pyplot state, no display.
matplotlib and numpy are imported inside the functions, so reading a run's
metrics stays light.
"""

from __future__ import annotations

import io
import math
import re
from collections.abc import Sequence
from typing import Any

from factory.report.run_metrics import RunMetrics

__all__ = ["ACTION_COLOURS", "CAPTIONS", "MARKS", "distributed_loss_png", "plots"]

ACTION_COLOURS = {"warn": "#f58518", "stop": "#d62728", "rollback": "#7b3294"}
OTHER_COLOUR = "#7f7f7f"
MAX_COLUMNS = 600
"""Heat maps bin longer runs to this many columns (the maximum of each bin)."""
MAX_CIRCLES = 100
"""Heat maps circle the layer an event named only for at most this many events of an action."""
WARN = {"marker": 2, "ls": "", "color": ACTION_COLOURS["warn"], "ms": 8, "mew": 1.2}
"""Warnings: a tick up from the top of the frame (matplotlib's TICKUP marker)."""
TITLE_PAD = 12
"""Points between the frame and a title: room for the warning ticks."""
CHECKPOINT = {"marker": "^", "ls": "", "color": "#1b9e77", "ms": 6}
PAGE_WIDTH = 9.0
"""Inches (100 px each) of a plot on the run page, one plot a row."""
COLUMN_WIDTH = 6.0
"""Inches of a plot in one of the build page's two columns (about 580 px at 1400 px)."""
LEGEND_SIZE = 10
"""Points: legends read like the axis labels, not smaller."""


def _colour(action: str) -> str:
    return ACTION_COLOURS.get(action, OTHER_COLOUR)


def _finite(value: float) -> float:
    return value if math.isfinite(value) else math.nan  # matplotlib breaks lines at NaN, not inf


def _discarded(metrics: RunMetrics) -> list[tuple[int, int]]:
    """The updates each rollback threw away: from the last update at ``to_step`` to the rollback."""
    spans = []
    for rollback in metrics.rollbacks:
        earlier = [
            s.update
            for s in metrics.steps
            if s.update <= rollback.update and s.step <= rollback.to_step
        ]
        spans.append((max(earlier, default=rollback.update), rollback.update))
    return spans


def _actions(metrics: RunMetrics) -> list[str]:
    """The actions that occurred, warn, stop, rollback first (the legend's order)."""
    order = {action: i for i, action in enumerate(ACTION_COLOURS)}
    return sorted({e.action for e in metrics.events}, key=lambda a: (order.get(a, len(order)), a))


def _mark(ax: Any, metrics: RunMetrics, on_map: bool = False) -> None:
    """Stop and rollback events as vertical lines, warnings as ticks above the frame, each
    rollback as a span over the updates it discarded with an arrow back to where training
    resumed, checkpoints as triangles on the x axis. On a heat map the span is a dashed
    white outline: a tint would change the colours it is read by."""
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # updates are whole: no 0.5 ticks
    limits = ax.get_xlim(), ax.get_ylim()
    across = ax.get_xaxis_transform()  # x in updates, y from 0 (bottom) to 1 (top)
    span_colour = "white" if on_map else _colour("rollback")
    for start, stop in _discarded(metrics):
        if on_map:
            ax.axvspan(start, stop, fill=False, edgecolor="white", ls="--", lw=1.2)
        else:
            ax.axvspan(start, stop, color=_colour("rollback"), alpha=0.13, lw=0)
        arrow = {"arrowstyle": "->", "color": span_colour, "lw": 1.2}
        ax.annotate("", (start, 0.94), (stop, 0.94), xycoords=across, arrowprops=arrow)
    for action in _actions(metrics):
        updates = [e.update for e in metrics.events if e.action == action]
        if action == "warn":  # a run may warn thousands of times: tick above the frame
            ticks = [1.0] * len(updates)
            ax.plot(updates, ticks, transform=across, clip_on=False, **WARN)
        else:
            ax.vlines(updates, 0, 1, transform=across, colors=_colour(action), lw=1.2, alpha=0.8)
    if metrics.checkpoints:
        # A checkpoint is taken between updates (its ``update`` is the next one); the one
        # written at the end sits on the last update, inside the frame.
        right = limits[0][1]
        ticks = [min(c.update - 0.5, right) for c in metrics.checkpoints]
        ax.plot(ticks, [0.0] * len(ticks), transform=across, clip_on=False, **CHECKPOINT)
    # vlines and plot in axes units would otherwise stretch the data limits
    ax.set_xlim(*limits[0])
    ax.set_ylim(*limits[1])


def _legend(figure: Any, metrics: RunMetrics, handles: list[Any], on_map: bool = False) -> None:
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    for action in _actions(metrics):
        style = WARN if action == "warn" else {"color": _colour(action)}
        handles.append(Line2D([], [], label=f"{action} event", **style))
    if metrics.rollbacks:
        label = "rolled back (updates discarded)"
        span: dict[str, Any] = {"color": _colour("rollback"), "alpha": 0.25}
        if on_map:
            span = {"fill": False, "edgecolor": "#555555", "ls": "--"}
        handles.append(Patch(label=label, **span))
    if metrics.checkpoints:
        handles.append(Line2D([], [], label="checkpoint", **CHECKPOINT))
    if handles:
        ncol = min(len(handles), 7)
        figure.legend(handles=handles, loc="outside lower center", ncol=ncol, fontsize=LEGEND_SIZE)


def _figure(height: float, width: float = PAGE_WIDTH) -> Any:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, height), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)  # draws without pyplot's global state or a display
    return figure


def _png(figure: Any) -> bytes:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", metadata={"Software": None})
    return buffer.getvalue()


def _dots(updates: list[int]) -> dict[str, Any]:
    """Markers while a run is short: a line through one or two points is hard to see."""
    return {"marker": "." if len(updates) < 30 else ""}


def _loss_png(metrics: RunMetrics, width: float) -> bytes:
    figure = _figure(5.2, width)
    top, bottom = figure.subplots(2, 1, sharex=True, height_ratios=[3, 1])
    updates = [s.update for s in metrics.steps]
    # blues: orange, red and purple belong to the events
    loss, lm_loss = ([_finite(getattr(s, a)) for s in metrics.steps] for a in ("loss", "lm_loss"))
    top.plot(updates, loss, lw=1.2, color="#9ecae1", label="loss", **_dots(updates))
    top.plot(updates, lm_loss, color="#08519c", label="LM loss", **_dots(updates))
    _heldout(top, metrics)
    top.set_ylabel("loss")
    top.set_title(f"{metrics.name}: loss", pad=TITLE_PAD)
    bottom.plot(updates, [s.step for s in metrics.steps], color="#555555", lw=1.0)
    bottom.set_ylabel("schedule step")
    bottom.set_xlabel("optimizer update")
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
        _mark(ax, metrics)
    _legend(figure, metrics, top.get_legend_handles_labels()[0])
    return _png(figure)


HELDOUT_COLOURS = ("#31a354", "#74c476", "#006d2c", "#a1d99b", "#00441b", "#41ab5d")
"""Greens, one per held-out set (blues are the training loss; orange, red and purple the
events)."""


def _heldout(ax: Any, metrics: RunMetrics) -> None:
    """The held-out loss of every set (dashed) and of all together (solid, square marks),
    at the update each evaluation followed."""
    curves = metrics.heldout_curves()
    sets = [category for category in curves if category is not None]
    for index, category in enumerate(sets):
        records = curves[category]
        colour = HELDOUT_COLOURS[index % len(HELDOUT_COLOURS)]
        x, y = [r.update for r in records], [_finite(r.loss) for r in records]
        ax.plot(x, y, "--", color=colour, lw=1.0, marker=".", label=f"held-out {category}")
    overall = curves.get(None)
    if overall:
        x, y = [r.update for r in overall], [_finite(r.loss) for r in overall]
        ax.plot(
            x,
            y,
            linestyle="solid",
            color="#006d2c",
            lw=1.6,
            marker="s",
            ms=4,
            label="held-out, all sets",
        )


def _line_png(metrics: RunMetrics, attr: str, title: str, log: bool, width: float) -> bytes:
    figure = _figure(3.6, width)
    ax = figure.subplots()
    updates = [s.update for s in metrics.steps]
    values = [_finite(getattr(s, attr)) for s in metrics.steps]
    ax.plot(updates, values, lw=1.1, color="#4c78a8", **_dots(updates))
    if log:
        ax.set_yscale("log")
    handles = []
    bad = [s.update for s in metrics.steps if not s.finite or math.isnan(_finite(getattr(s, attr)))]
    if bad:
        style = {"color": "#d62728", "ms": 7, "clip_on": False, "label": "non-finite step"}
        handles = ax.plot(bad, [1.0] * len(bad), "x", transform=ax.get_xaxis_transform(), **style)
    ax.set(xlabel="optimizer update", ylabel=title)
    ax.set_title(f"{metrics.name}: {title}", pad=TITLE_PAD)
    ax.grid(alpha=0.3, which="both" if log else "major")
    _mark(ax, metrics)
    _legend(figure, metrics, list(handles))
    return _png(figure)


def _natural(name: str) -> list[Any]:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def _layers(metrics: RunMetrics, attr: str) -> list[str]:
    """Layers with values, in the run's layer order (natural order for any it does not list)."""
    names = {name for s in metrics.steps for name in getattr(s, attr)}
    order = {name: i for i, name in enumerate(metrics.run.layers if metrics.run else ())}
    return sorted(names, key=lambda n: (order.get(n, len(order)), _natural(n)))


def _heatmap_png(
    metrics: RunMetrics, attr: str, label: str, log: bool, width: float
) -> bytes | None:
    import numpy as np
    from matplotlib.colors import LogNorm, Normalize

    layers = _layers(metrics, attr)
    if not layers:
        return None
    updates = np.array([s.update for s in metrics.steps])
    grid = np.array([[getattr(s, attr).get(n, np.nan) for s in metrics.steps] for n in layers])
    grid[~np.isfinite(grid) | ((grid <= 0) if log else False)] = np.nan
    # Long runs: one column per bin, its worst (largest) value, so a spike never averages away.
    starts = np.arange(0, len(updates), math.ceil(len(updates) / MAX_COLUMNS))
    grid = np.fmax.reduceat(grid, starts, axis=1)
    edges = np.append(updates[starts] - 0.5, updates[-1] + 0.5)
    seen = grid[np.isfinite(grid)]
    low, high = (seen.min(), seen.max()) if seen.size else (1.0, 1.0)
    norm = LogNorm(low, max(high, low * 1.01)) if log else Normalize(0.0, max(high, 1e-9))
    figure = _figure(min(2.4 + 0.14 * len(layers), 10.0), width)
    ax = figure.subplots()
    ax.set_facecolor("#dddddd")  # grey: no value logged for that layer at that update
    rows = np.arange(len(layers) + 1) - 0.5
    mesh = ax.pcolormesh(edges, rows, np.ma.masked_invalid(grid), norm=norm, cmap="viridis")
    figure.colorbar(mesh, ax=ax, label=label, pad=0.01)
    prefix = _prefix(layers)
    ticks = list(range(0, len(layers), math.ceil(len(layers) / 24)))
    ax.set_yticks(ticks, [layers[i][len(prefix) :] for i in ticks], fontsize=8)
    ax.set_ylim(len(layers) - 0.5, -0.5)  # first layer on top
    ax.set(xlabel="optimizer update", ylabel=f"layer ({prefix}N)" if prefix else "layer")
    ax.set_title(f"{metrics.name}: {label} per layer", pad=TITLE_PAD)
    _circle_layers(ax, metrics, attr, layers)
    _mark(ax, metrics, on_map=True)
    _legend(figure, metrics, [], on_map=True)
    return _png(figure)


def _circle_layers(ax: Any, metrics: RunMetrics, attr: str, layers: list[str]) -> None:
    """Circle the cell of each ``attr`` event that names its layer: which layer tripped it."""
    row = {name: i for i, name in enumerate(layers)}
    for action in _actions(metrics):
        named = [e for e in metrics.events if e.action == action and e.monitor == attr]
        cells = [(e.update, row[e.layer]) for e in named if e.layer in row]
        if 0 < len(cells) <= MAX_CIRCLES:  # more would hide the map; the table lists them
            x, y = zip(*cells, strict=True)
            ax.plot(x, y, "o", mfc="none", mec=_colour(action), mew=1.5)


def _prefix(names: list[str]) -> str:
    """The dotted prefix every name shares (``backbone.layers.``), shortening the tick labels."""
    shared = []
    for column in zip(*(name.split(".")[:-1] for name in names), strict=False):
        if len(set(column)) > 1:
            break
        shared.append(column[0])
    return "".join(f"{part}." for part in shared)


MARKS = (
    "Orange ticks above the frame are warnings; vertical lines are stops (red) and rollback "
    "events (purple); a shaded span (a dashed outline on heat maps) is the updates a rollback discarded, its arrow "
    "pointing back to where training resumed; green triangles on the x axis are checkpoints."
)
CAPTIONS = {
    "loss.png": "Loss (what is optimised, auxiliary terms included) and LM loss per "
    "optimizer update; in green, the held-out loss (training.eval) of each set, dashed, and "
    "of all sets together, at the update each evaluation followed; below, the schedule "
    "step, which drops at each rollback.",
    "lr.png": "Learning rate per optimizer update; crosses at the top are non-finite steps.",
    "grad_norm.png": "Gradient norm per optimizer update, log scale; crosses at the top are "
    "non-finite steps.",
    "max_vio.png": "MaxVio of every MoE layer (how far the busiest expert is above an even "
    "load, relative to it): layers top to bottom, updates left to right; circles are the "
    "layers a MaxVio event named.",
    "residual_rms.png": "RMS of the residual stream at every layer, log colour scale: a "
    "layer whose row brightens over time is growing the stream; circles are the layers a "
    "residual RMS event named.",
}


def plots(metrics: RunMetrics, width: float = PAGE_WIDTH) -> list[tuple[str, bytes]]:
    """(file name, PNG) of every plot the run has data for (no MoE layers: no MaxVio map),
    ``width`` inches wide: the width the page shows them at, so their text reads at its size."""
    drawn = {
        "loss.png": _loss_png(metrics, width),
        "lr.png": _line_png(metrics, "lr", "learning rate", log=False, width=width),
        "grad_norm.png": _line_png(metrics, "grad_norm", "gradient norm", log=True, width=width),
        "max_vio.png": _heatmap_png(metrics, "max_vio", "MaxVio", log=False, width=width),
        "residual_rms.png": _heatmap_png(
            metrics, "residual_rms", "residual RMS", log=True, width=width
        ),
    }
    return [(name, png) for name, png in drawn.items() if png is not None]


def distributed_loss_png(
    steps: Sequence[int],
    losses: Sequence[float],
    smoke_losses: Sequence[float],
    tolerance: float,
    title: str,
    reference: str = "smoke (1 process)",
) -> bytes:
    """The distributed run's losses over the smoke run's (or another one-process run's,
    named ``reference``) at the same steps, and below, their relative difference."""
    from matplotlib.ticker import MaxNLocator

    figure = _figure(4.6, width=COLUMN_WIDTH)
    top, bottom = figure.subplots(2, 1, sharex=True, height_ratios=[3, 1])
    shared = min(len(steps), len(losses), len(smoke_losses))
    x = list(steps)[:shared]
    top.plot(x, list(smoke_losses)[:shared], "o-", color="#9ecae1", lw=3, ms=7, label=reference)
    top.plot(x, list(losses)[:shared], "x--", color="#08519c", ms=8, label="distributed")
    top.set(ylabel="loss", title=title)
    difference = [
        abs(a - b) / max(abs(b), 1e-12)
        for a, b in zip(losses[:shared], smoke_losses[:shared], strict=True)
    ]
    bottom.plot(x, difference, "o-", color="#555555", ms=4, label="relative difference")
    bottom.axhline(tolerance, color="#d62728", ls="--", lw=1, label="tolerance")
    bottom.set(xlabel="step", ylabel="rel. diff.", ylim=(0, max([tolerance, *difference]) * 1.15))
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    # One legend below both panels: inside either it would cover a curve or the tolerance line.
    handles = top.get_legend_handles_labels()[0] + bottom.get_legend_handles_labels()[0]
    figure.legend(handles=handles, loc="outside lower center", ncol=2, fontsize=LEGEND_SIZE)
    return _png(figure)
