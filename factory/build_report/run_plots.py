"""PNG plots of the smoke and distributed runs: the training report's own plots, and the
distributed check's losses over the smoke run's. matplotlib is imported only here, inside
the functions."""

from __future__ import annotations

import io
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from factory.runtime.report import ReportError, read_metrics
from factory.runtime.report_plots import CAPTIONS, plots

__all__ = ["SMOKE_PLOTS", "distributed_loss_png", "smoke_plots"]

SMOKE_PLOTS = ("loss.png", "max_vio.png", "residual_rms.png")
"""The training report's plots this page shows: the loss and the two per-layer monitors."""


def smoke_plots(run_dir: Path) -> tuple[list[tuple[str, bytes, str]], str | None]:
    """(file, PNG, caption) of the run's loss and monitor plots, and the reason when there are
    none (no metrics, or no step yet)."""
    try:
        metrics = read_metrics(run_dir)
    except ReportError as exc:
        return [], str(exc)
    if not metrics.steps:
        return [], f"{metrics.path}: no step recorded"
    drawn = [(f, png, CAPTIONS[f]) for f, png in plots(metrics) if f in SMOKE_PLOTS]
    return drawn, None


def _figure(width: float, height: float) -> Any:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, height), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)
    return figure


def distributed_loss_png(
    steps: Sequence[int],
    losses: Sequence[float],
    smoke_losses: Sequence[float],
    tolerance: float,
    title: str,
) -> bytes:
    """The distributed run's losses over the smoke run's at the same steps, and below, their
    relative difference."""
    figure = _figure(6.4, 4.6)
    top, bottom = figure.subplots(2, 1, sharex=True, height_ratios=[3, 1])
    shared = min(len(steps), len(losses), len(smoke_losses))
    x = list(steps)[:shared]
    top.plot(
        x, list(smoke_losses)[:shared], "o-", color="#9ecae1", lw=3, ms=7, label="smoke (1 process)"
    )
    top.plot(x, list(losses)[:shared], "x--", color="#08519c", ms=8, label="distributed")
    top.set(ylabel="loss", title=title)
    top.legend(fontsize=9)
    difference = [
        abs(a - b) / max(abs(b), 1e-12)
        for a, b in zip(losses[:shared], smoke_losses[:shared], strict=True)
    ]
    from matplotlib.ticker import MaxNLocator

    bottom.plot(x, difference, "o-", color="#555555", ms=4, label="relative difference")
    bottom.axhline(tolerance, color="#d62728", ls="--", lw=1, label="tolerance")
    bottom.set(xlabel="step", ylabel="rel. diff.", ylim=(0, max([tolerance, *difference]) * 1.15))
    bottom.legend(fontsize=8, loc="upper left")
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", metadata={"Software": None})
    return buffer.getvalue()
