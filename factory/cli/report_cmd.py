"""``factory report``: plots and an HTML page from a training run's metrics.jsonl."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from factory.cli.output import EXIT_INVALID
from factory.cli.root import app
from factory.report.run_metrics import ReportError
from factory.report.run_page import write_report


@app.command()
def report(
    run_dir: Annotated[Path, typer.Argument(help="The run's folder, holding metrics.jsonl.")],
    out: Annotated[
        Path | None,
        typer.Option("--out", help="Report folder (default RUN_DIR/report); replaced whole."),
    ] = None,
) -> None:
    """Render a training run's report.html.

    One self-contained page: loss, learning rate, gradient norm, MaxVio and residual RMS
    plots, and the monitor events.

    Works on a live run too: a last line the run is still writing is skipped.
    """
    try:
        page = write_report(run_dir, out)
    except ReportError as exc:
        print(exc, file=sys.stderr)
        raise typer.Exit(EXIT_INVALID) from None
    typer.echo(f"wrote {page}")
