"""``factory train``: :func:`factory.train` on a blueprint (or its CPU proxy), from the shell.

The job, its output folder and its refusals are documented in
``factory.jobs.train``; this module parses arguments and prints.
"""

from __future__ import annotations

import sys
import typing
from pathlib import Path
from typing import Annotated

import typer

from factory.cli.app import app
from factory.cli.output import EXIT_INVALID, print_diagnostics
from factory.cli.validate_cmd import SetOption

PRECISION_HELP = "Backend of the precision policy: auto, emulate, te or off (factory.compile's)."
"""Names the backends for --help, which must not import torch; a test holds it to the Literal."""


def parse_precision(value: str) -> str:
    """``value`` if it is one of ``factory.compile``'s ``PrecisionBackend`` names.

    Read from that ``Literal`` when the option is parsed, not when commands
    register: the module defining it imports torch, and ``factory validate``
    must not.
    """
    from factory.graph.compile import PrecisionBackend

    backends = typing.get_args(PrecisionBackend)
    if value not in backends:
        raise typer.BadParameter(f"{value!r} is not one of {', '.join(backends)}")
    return value


@app.command()
def train(
    target: Annotated[str, typer.Argument(help="Preset name or blueprint path.")],
    proxy: Annotated[bool, typer.Option("--proxy", help="Train the CPU proxy.")] = False,
    steps: Annotated[
        int | None, typer.Option("--steps", min=1, help="Optimizer steps (default: blueprint's).")
    ] = None,
    out: Annotated[
        Path | None, typer.Option("--out", help="Output folder (default: runs/NAME).")
    ] = None,
    data: Annotated[
        Path | None, typer.Option("--data", help="Train on shards already built here.")
    ] = None,
    precision: Annotated[
        str,
        typer.Option("--precision", parser=parse_precision, metavar="BACKEND", help=PRECISION_HELP),
    ] = "auto",
    seed: Annotated[int | None, typer.Option("--seed", help="Default: training.seed.")] = None,
    overrides: SetOption = None,
) -> None:
    """Train on the blueprint's data recipe; write train.json, model/ and data/."""
    from rich.console import Console

    from factory.jobs.progress import RichProgress
    from factory.jobs.train import TrainRefused
    from factory.jobs.train import train as train_job
    from factory.loading.load import load

    console = Console(stderr=True)
    loaded = load(target, overrides or [])
    print_diagnostics(loaded.warnings)
    try:
        with RichProgress(console) as progress:
            result = train_job(
                loaded.blueprint,
                out=out,
                proxy=proxy,
                steps=steps,
                data=data,
                precision=precision,  # type: ignore[arg-type]  # parse_precision checked it
                seed=seed,
                progress=progress,
                show_steps=sys.stderr.isatty(),
            )
    except TrainRefused as exc:
        console.print(f"factory train: {exc}", markup=False)
        raise typer.Exit(EXIT_INVALID) from None
    name, records = result.blueprint.meta.name, result.records
    if result.diverged:
        console.print(f"[red]diverged[/red] at step {len(records)}: see {result.out}")
        raise typer.Exit(1)
    if records:
        console.print(
            f"[green]trained[/green] {name}: {len(records)} steps, "
            f"loss {records[-1].lm_loss:.4f} -> {out or result.out}"
        )
