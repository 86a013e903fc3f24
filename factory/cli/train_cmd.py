"""``factory train``: :func:`factory.train` on a blueprint (or its CPU proxy), from the shell.

The job, its output folder and its refusals are documented in
``factory.jobs.train``; this module parses arguments and prints. Under a
launch (``--nproc`` or torchrun) rank 0 alone prints a refusal, every rank exits
with the same status, and torchrun's failure summary repeats the line
(``factory.jobs.launch.tell_torchrun``). Exit statuses: 0 trained, 1 a run that
ended early or failed (a monitor's stop, a checkpoint that could not be
written), 2 a request refused, 3 a rank whose collective failed because another
rank died (the failure is elsewhere: ``--nproc`` names the rank that failed
first and was not such a rank), 128 + the signal's number for a run stopped by
SIGTERM (143) or SIGINT (130) after its checkpoint.
"""

from __future__ import annotations

import os
import sys
import typing
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, NoReturn

import typer
from rich.console import Console
from rich.text import Text

from factory.checks.validate import load
from factory.cli.output import EXIT_INVALID, print_diagnostics
from factory.cli.progress_output import LogFormatOption, progress_console
from factory.cli.root import app
from factory.cli.validate_cmd import SetOption
from factory.data.build_refusals import BuildRefused
from factory.jobs.launch import (
    launched_world_size,
    shutdown_grace_seconds,
    tell_torchrun,
    torchrun_args,
)
from factory.jobs.run_lock import HELD_BY_LAUNCHER, RunFolderBusy, held_run_folder
from factory.jobs.train import prepare_program, prepare_training, run_training
from factory.jobs.train_errors import CannotLaunch, RankLost, TrainRefused
from factory.jobs.train_program import ProgramRequest, ProgramResult, run_program
from factory.jobs.train_request import CheckpointPolicy, TrainRequest, TrainResult, TrainSettings
from factory.precision.backends import PrecisionBackend
from factory.progress import LogFormat, RichProgress
from factory.runtime.checkpoint_errors import CheckpointWriteError
from factory.runtime.stop_signals import exit_status

if TYPE_CHECKING:
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

BACKENDS = typing.get_args(PrecisionBackend)
EXIT_RANK_LOST = 3
"""A rank's status when its collective failed because another rank died or hung."""

PRECISION_HELP = f"Backend of the precision policy: {', '.join(BACKENDS)} (factory.compile's)."


def parse_precision(value: str) -> str:
    """``value`` if it is one of ``factory.compile``'s ``PrecisionBackend`` names."""
    if value not in BACKENDS:
        raise typer.BadParameter(f"{value!r} is not one of {', '.join(BACKENDS)}")
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
    resume: Annotated[
        bool,
        typer.Option(
            "--resume",
            help="Continue from the latest complete checkpoint in --out (an error if none; "
            "rerunning into a folder that has one resumes anyway).",
        ),
    ] = False,
    checkpoint_every: Annotated[
        int | None,
        typer.Option(
            "--checkpoint-every", min=1, help="Steps between checkpoints (default: blueprint's)."
        ),
    ] = None,
    keep: Annotated[
        int, typer.Option("--keep-checkpoints", min=1, help="Complete checkpoints kept.")
    ] = 3,
    async_checkpoint: Annotated[
        bool,
        typer.Option("--async-checkpoint", help="Write checkpoints in the background."),
    ] = False,
    nproc: Annotated[
        int | None,
        typer.Option(
            "--nproc",
            min=1,
            help="Start N processes on this machine with torchrun (the same as "
            "'torchrun --nproc-per-node N -m factory train ...').",
        ),
    ] = None,
    stage: Annotated[
        str | None,
        typer.Option(
            "--stage",
            metavar="NAME",
            help="Train (or resume) this stage of the blueprint's program alone; its "
            "predecessor must have finished (default: every stage, resuming where the "
            "program stopped).",
        ),
    ] = None,
    overrides: SetOption = None,
    log_format: LogFormatOption = LogFormat.auto,
) -> None:
    """Train a blueprint (or its CPU proxy) on its data recipe.

    With checkpoints and stability monitors; writes data/, checkpoints/, metrics.jsonl, and
    at the end train.json, model/ and report/. A blueprint with stages trains them in order,
    one such folder per stage under --out, with program.json (--steps and --data then apply
    per stage: N steps each, DATA/<stage>/).
    """
    console = progress_console(log_format)
    loaded = load(target, overrides or [])
    main_rank = os.environ.get("RANK", "0") == "0"
    relaunch = nproc is not None and launched_world_size() == 1
    world = nproc if relaunch else launched_world_size()
    progress = RichProgress(console, log_format=log_format)
    settings = TrainSettings(
        out=out,
        steps=steps,
        data=data,
        seed=seed,
        progress=progress,
        show_steps="plain" if progress.plain else "rich",
        checkpoints=CheckpointPolicy(checkpoint_every, keep, async_checkpoint, resume),
        notice=_notices(console, main_rank),
    )
    request: TrainRequest | ProgramRequest
    try:
        if loaded.blueprint.stages is not None:
            request = prepare_program(
                loaded.blueprint, settings, proxy=proxy, precision=precision,  # type: ignore[arg-type]
                world_size=world, stage=stage,
            )  # fmt: skip
        elif stage is not None:
            raise TrainRefused(f"--stage {stage}: {loaded.blueprint.meta.name} has no stages")
        else:
            request = prepare_training(
                loaded.blueprint, settings, proxy=proxy, precision=precision, world_size=world
            )  # type: ignore[arg-type]  # parse_precision checked it
    except CannotLaunch as exc:
        diagnostic = loaded.source_map.diagnostic(exc.path, str(exc), rule=exc.rule)
        _refuse(diagnostic.format(), main_rank)
    except (TrainRefused, ValueError) as exc:  # ValueError: a request that contradicts itself
        _refuse(f"factory train: {exc}", main_rank)
    if main_rank:  # one copy of each, once accepted: a refusal repeats its runtime.* warning
        print_diagnostics(loaded.warnings)
    if relaunch:
        raise typer.Exit(_launch(request, world, console))
    if main_rank:
        _say_layout_changes(request, console)
    try:
        with progress:
            if isinstance(request, ProgramRequest):
                result: TrainResult | ProgramResult = run_program(request)
            else:
                result = run_training(request)
    except (TrainRefused, BuildRefused) as exc:  # BuildRefused: the recipe curated to nothing
        _refuse(f"factory train: {exc}", main_rank)
    except (RankLost, CheckpointWriteError) as exc:  # each rank says what it saw
        console.print(f"factory train: {exc}", markup=False, soft_wrap=True)
        raise typer.Exit(EXIT_RANK_LOST if isinstance(exc, RankLost) else 1) from None
    _say_how_it_ended(result, console, main_rank)


def _say_layout_changes(request: TrainRequest | ProgramRequest, console: Console) -> None:
    """What the proxy's layout changed to fit the launch (per stage of a program)."""
    stages = request.stages if isinstance(request, ProgramRequest) else (request,)
    for one in stages:
        if one.layout_changes:
            where = f" of stage {one.stage.name}" if one.stage is not None else ""
            changes = "; ".join(one.layout_changes)
            console.print(f"proxy layout{where}: {changes}", markup=False, highlight=False)


def _refuse(line: str, main_rank: bool) -> NoReturn:
    """Exit 2 with ``line`` printed once (by rank 0 of a launch) and handed to torchrun."""
    if main_rank:
        print(line, file=sys.stderr)
    tell_torchrun(line)
    raise typer.Exit(EXIT_INVALID)


def _notices(console: Console, main_rank: bool) -> Callable[[str], None]:
    def notice(line: str) -> None:
        if main_rank:
            console.print(f"factory train: {line}", markup=False, highlight=False, soft_wrap=True)

    return notice


def _launch(request: TrainRequest | ProgramRequest, world: int, console: Console) -> int:
    """``--nproc``: hold the run folder, then run torchrun here; its ranks know it is held."""
    folder = request.out
    try:
        with held_run_folder(folder):
            os.environ[HELD_BY_LAUNCHER] = str(folder)
            try:
                return _torchrun(torchrun_args(world, _without_nproc(sys.argv[1:])), console)
            finally:
                del os.environ[HELD_BY_LAUNCHER]
    except RunFolderBusy as exc:
        print(f"factory train: {exc}", file=sys.stderr)
        return EXIT_INVALID


def _say_how_it_ended(
    result: TrainResult | ProgramResult, console: Console, main_rank: bool
) -> None:
    """One line for how the run (a program's: its last stage) ended, and the exit status."""
    name, records, history = result.blueprint.meta.name, result.records, result.history
    last = result.last if isinstance(result, ProgramResult) else result
    if isinstance(result, ProgramResult):
        stages = ", ".join(one.out.name for one in result.stages)
        name = f"{name} (stage{'s' if len(result.stages) > 1 else ''} {stages})"
    if result.found_complete_at is not None:
        if main_rank:
            console.print(f"factory train: {name} already complete at step "
                          f"{result.found_complete_at} ({result.out}); nothing to do",
                          markup=False, highlight=False, soft_wrap=True)  # fmt: skip
        raise typer.Exit(0)
    if history.end == "interrupted":
        if main_rank:
            console.print(f"factory train: {history.message}; rerun the same command to resume",
                          markup=False, highlight=False, soft_wrap=True)  # fmt: skip
        raise typer.Exit(exit_status(history.signal))
    if not main_rank:
        raise typer.Exit(0 if history.end == "completed" else 1)
    if history.end != "completed":
        line = f": {history.message}; resumable checkpoint and metrics in {result.out}"
        console.print(Text.assemble((history.end, "red"), line), highlight=False)
        raise typer.Exit(1)
    if records:
        line = f" {name}: {len(records)} steps, loss {records[-1].lm_loss:.4f} -> {result.out}"
        console.print(Text.assemble(("trained", "green"), line), highlight=False)
    report = last.out / "report" / "report.html"
    if report.is_file():
        console.print(f"report: {report}", markup=False, highlight=False)


def _without_nproc(argv: list[str]) -> list[str]:
    """``argv`` minus ``--nproc N`` / ``--nproc=N`` (the relaunched processes must not
    relaunch)."""
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--nproc":
            skip = True
        elif not arg.startswith("--nproc="):
            kept.append(arg)
    return kept


def _torchrun(args: list[str], console: Console) -> int:
    """Run torchrun here (it starts the workers); on a failure say which rank failed first
    instead of torchrun's traceback."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    parsed = get_args_parser().parse_args(args)
    if hasattr(parsed, "shutdown_timeout"):  # torchrun's own default (30 s) cuts a checkpoint
        parsed.shutdown_timeout = shutdown_grace_seconds()
    try:
        run(parsed)
    except SignalException as exc:  # torchrun passed it to the ranks, which said how they ended
        return exit_status(int(exc.sigval))
    except ChildFailedError as exc:
        rank, first = _root_failure(exc.failures)
        if first.exitcode == EXIT_INVALID:  # a refusal: rank 0 said why, and no step ran
            return EXIT_INVALID
        how = f"signal {-first.exitcode}" if first.exitcode < 0 else f"exit {first.exitcode}"
        console.print(
            f"factory train: rank {rank} failed first ({how}); torchrun stopped the "
            f"other ranks. Logs of each rank are above; resume with the same command.",
            highlight=False,
        )
        return 1
    return 0


def _root_failure(failures: dict[int, ProcessFailure]) -> tuple[int, ProcessFailure]:
    """The global rank that failed first, and how, among those that did not merely lose
    another rank. torchrun's own choice (the smallest timestamp) cannot tell them apart:
    its timestamps are whole seconds, so a rank killed outright and the rank that then
    saw its collective fail usually tie, and the tie goes to the lower rank."""
    causes = {r: f for r, f in failures.items() if f.exitcode != EXIT_RANK_LOST} or failures
    return min(causes.items(), key=lambda item: (item[1].timestamp, item[0]))
