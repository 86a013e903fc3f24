"""``factory average``: average a run's kept checkpoints into one, with its HF export."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from factory.cli.output import EXIT_INVALID
from factory.cli.root import app
from factory.runtime.checkpoint_errors import CheckpointError


def _steps(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise typer.BadParameter(f"{text!r}: steps are integers, comma-separated") from None


@app.command("average")
def average_cmd(
    run: Annotated[Path, typer.Argument(help="A training's run folder.")],
    last: Annotated[
        int | None, typer.Option("--last", help="Average the newest K kept checkpoints.")
    ] = None,
    steps: Annotated[
        str | None,
        typer.Option("--steps", help="Average the checkpoints of these steps (100,200,...)."),
    ] = None,
    ema: Annotated[
        float | None,
        typer.Option(
            "--ema",
            help="Exponential weights: the newest 1, each older checkpoint DECAY times the "
            "next (normalised); default uniform.",
        ),
    ] = None,
    name: Annotated[
        str | None,
        typer.Option("--name", help="RUN/averaged/NAME (default: last4, steps100_200, ...)."),
    ] = None,
    stage: Annotated[
        str | None,
        typer.Option("--stage", help="The program's stage whose checkpoints (default: final)."),
    ] = None,
    no_export: Annotated[
        bool, typer.Option("--no-export", help="Write the averaged checkpoint alone.")
    ] = False,
) -> None:
    """Average a run's kept checkpoints into one.

    Their fp32 masters, uniformly or with --ema, into RUN/averaged/NAME/: checkpoint/ (a
    training checkpoint's DCP layout), average.json (source steps and weights) and model/
    (its Hugging Face export; `factory export hf RUN --averaged NAME` copies it). Within
    one stage of a program.
    """
    # The averaging job reads checkpoints with torch: imported when the command runs.
    from factory.jobs.average import AverageRefused, average

    try:
        result = average(
            run,
            last=last,
            steps=_steps(steps),
            ema=ema,
            name=name,
            stage=stage,
            export=not no_export,
        )
    except AverageRefused as exc:
        typer.echo(f"{run}: {exc}", err=True)
        raise typer.Exit(EXIT_INVALID) from None
    except CheckpointError as exc:
        typer.echo(f"{run}: {exc}", err=True)
        raise typer.Exit(1) from None
    weights = ", ".join(
        f"{step}: {weight:.4g}" for step, weight in zip(result.steps, result.weights, strict=True)
    )
    typer.echo(f"averaged steps {weights} -> {result.folder}")
    if result.model is not None:
        typer.echo(f"wrote {result.model}/config.json and {result.model}/model.safetensors")
