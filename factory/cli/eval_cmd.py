"""``factory eval``: loss and perplexity per held-out category of a run's checkpoint or an
exported HF folder (``factory.jobs.evaluate``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from factory.cli.output import EXIT_INVALID
from factory.cli.root import app
from factory.jobs.evaluate import EvalRefused, EvalResult, prepare_eval, run_eval
from factory.runtime.checkpoint_errors import CheckpointError


@app.command("eval")
def eval_cmd(
    model: Annotated[
        Path,
        typer.Argument(
            metavar="MODEL_OR_RUN",
            help="A training's run folder (its newest checkpoint, or --step) or an HF folder "
            "(factory export hf, a run's model/).",
        ),
    ],
    data: Annotated[
        Path | None,
        typer.Option(
            "--data",
            help="A data build's output (its held-out sets) or one built folder (default for "
            "a run: the data it trained on).",
        ),
    ] = None,
    tokens: Annotated[
        int | None,
        typer.Option(
            "--tokens",
            help="Positions read from each set (default: the run's training.eval.tokens, "
            "else 65536).",
        ),
    ] = None,
    step: Annotated[
        int | None, typer.Option("--step", help="The run's checkpoint of this step.")
    ] = None,
    stage: Annotated[
        str | None, typer.Option("--stage", help="A program's stage (default: the final one).")
    ] = None,
    sets: Annotated[
        list[str] | None, typer.Option("--set", help="Evaluate this held-out set (repeatable).")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the result as JSON.")] = False,
) -> None:
    """Held-out loss and perplexity per category, and over all of them.

    The token-weighted next-token cross-entropy over the loss-masked targets of each packed
    document (training's loss), with the MTP depths' where the model has MTP, on the first
    --tokens positions of each set. For a run's checkpoint it is the number training.eval
    recorded at that step; for an HF folder, the number transformers computes.
    """
    try:
        request = prepare_eval(
            model, data, tokens=tokens, step=step, stage=stage, sets=tuple(sets or ()) or None
        )
        result = run_eval(request)
    except EvalRefused as exc:
        print(f"factory eval: {exc}", file=sys.stderr)
        raise typer.Exit(EXIT_INVALID) from None
    except CheckpointError as exc:
        print(f"factory eval: MODEL_OR_RUN: {exc}", file=sys.stderr)
        raise typer.Exit(EXIT_INVALID) from None
    if as_json:
        typer.echo(json.dumps(result.as_json(), indent=2))
        return
    _print_table(result)


def _print_table(result: EvalResult) -> None:
    request = result.request
    where = f"step {request.step}" if request.kind == "run" else "HF folder"
    table = Table(title=f"{request.model} ({where}), up to {request.tokens:,} tokens per set")
    depths = max((len(r.mtp_losses) for r in result.records), default=0)
    for column in ("set", "loss", "perplexity", "tokens"):
        table.add_column(column, justify="left" if column == "set" else "right")
    for depth in range(1, depths + 1):
        table.add_column(f"MTP {depth}", justify="right")
    for record in result.records:
        mtp = [f"{record.mtp_losses.get(str(d), float('nan')):.4f}" for d in range(1, depths + 1)]
        if record.category is None:
            table.add_section()
        name = record.category if record.category is not None else "all"
        row = [name, f"{record.loss:.4f}", f"{record.perplexity:.3f}", f"{record.tokens:,}"]
        table.add_row(*row, *mtp)
    Console(soft_wrap=True).print(table)
