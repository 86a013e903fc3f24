"""``factory build``: validate a blueprint, then :func:`factory.build` runs every stage."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.text import Text

import factory
from factory.checks.validate import load
from factory.cli.output import EXIT_INVALID, print_diagnostics
from factory.cli.progress_output import LogFormatOption, progress_console
from factory.cli.root import app
from factory.cli.validate_cmd import SetOption
from factory.errors import BlueprintError
from factory.jobs.build_defaults import (
    DEFAULT_CHECK_STEPS,
    DEFAULT_SMOKE_STEPS,
    DEFAULT_STAGE_SMOKE_STEPS,
)
from factory.progress import LogFormat, RichProgress, plain_log, stamped
from factory.report.build_folder import STAGES
from factory.report.units import human_bytes

if TYPE_CHECKING:
    from factory.jobs.build import StageRecord

_MARK = {"done": ("✓", "green"), "reused": ("✓", "green"), "skipped": ("-", "dim")}
_FAILED = ("✗", "red")


@app.command()
def build(
    target: Annotated[str, typer.Argument(help="Preset name or blueprint path.")],
    out: Annotated[
        Path | None, typer.Option("--out", help="Build folder (default: build/NAME).")
    ] = None,
    steps: Annotated[
        int | None,
        typer.Option(
            "--steps",
            min=2,
            help=f"Optimizer steps of the proxy's smoke run (default {DEFAULT_SMOKE_STEPS}); "
            f"for a program, per stage (default {DEFAULT_STAGE_SMOKE_STEPS}).",
        ),
    ] = None,
    check_steps: Annotated[
        int,
        typer.Option("--check-steps", min=1, help="Steps of the 2-process layout check."),
    ] = DEFAULT_CHECK_STEPS,
    skip: Annotated[
        list[str] | None,
        typer.Option("--skip", help=f"A stage not to run (repeatable): {', '.join(STAGES)}."),
    ] = None,
    workers: Annotated[int, typer.Option("--workers", min=1, help="Data worker processes.")] = 1,
    overrides: SetOption = None,
    log_format: LogFormatOption = LogFormat.auto,
) -> None:
    """Run every stage on a blueprint, into one folder and one report.

    Validate, plan, the model on the meta device, the precision table, the HF and Megatron
    exports, the curated data, a smoke run of the proxy and a 2-process layout check. A
    program (a blueprint with stages) is curated and smoke-trained stage by stage, and its
    page draws the program on one timeline. A rerun reuses what is done.
    """
    console = progress_console(log_format)
    for stage in skip or []:
        if stage not in STAGES:
            raise typer.BadParameter(
                f"{stage!r} is not a stage; stages: {', '.join(STAGES)}", param_hint="--skip"
            )
    with console.status("validating"):
        loaded = load(target, overrides or [])
    print_diagnostics(loaded.warnings)

    plain = plain_log(log_format, console)

    def say(record: StageRecord) -> None:
        reused = " (reused)" if record.status == "reused" else ""
        line = f" {record.stage:<11} {record.seconds:7.1f} s  {record.result}{reused}"
        console.print(
            Text.assemble(stamped("") if plain else "", _MARK.get(record.status, _FAILED), line),
            highlight=False,
            soft_wrap=True,  # one line per stage, also in logs narrower than the line
        )

    try:
        with RichProgress(console, log_format=log_format) as progress:
            result = factory.build(  # imports numpy and torch when it runs
                loaded.blueprint,
                out=out,
                source=loaded.source,
                steps=steps,
                check_steps=check_steps,
                skip=skip or [],
                workers=workers,
                progress=progress,
                on_stage=say,
            )
    except BlueprintError as exc:  # the data recipe the blueprint names
        print_diagnostics(exc.diagnostics)
        raise typer.Exit(EXIT_INVALID) from None
    except ValueError as exc:  # options that contradict each other
        console.print(f"factory build: {exc}", markup=False, highlight=False)
        raise typer.Exit(EXIT_INVALID) from None
    except factory.BuildFailed as exc:
        console.print(Text.assemble(("build failed", "red"), f" at {exc}"), highlight=False)
        raise typer.Exit(1) from None
    report = result.out / "report.html"
    where = f"; report: {report}" if report.is_file() else ""
    size = human_bytes(result.size)
    line = f" {loaded.blueprint.meta.name} -> {result.out} ({size}){where}"
    console.print(Text.assemble(("built", "green"), line), highlight=False)
