"""``factory build``: validate a blueprint, then :func:`factory.build` writes its build folder."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from factory.cli.output import print_diagnostics
from factory.cli.root import app
from factory.cli.validate_cmd import SetOption
from factory.jobs.build import build as build_job
from factory.jobs.progress import RichProgress


@app.command()
def build(
    target: Annotated[str, typer.Argument(help="Preset name or blueprint path.")],
    out: Annotated[
        Path | None, typer.Option("--out", help="Build folder (default: build/NAME).")
    ] = None,
    overrides: SetOption = None,
) -> None:
    """Validate, plan, and write resolved.yaml, plan.json, report.md, report.html and data/."""
    from rich.console import Console

    from factory.loading.load import load

    console = Console(stderr=True)
    with console.status("validating"):
        loaded = load(target, overrides or [])
    print_diagnostics(loaded.warnings)
    with RichProgress(console) as progress:
        result = build_job(loaded.blueprint, out=out, source=loaded.source, progress=progress)
    params = result.plan.params
    console.print(
        f"[green]built[/green] {loaded.blueprint.meta.name} -> {out or result.out}: "
        f"{params.total:,} parameters ({params.active:,} active)"
    )
