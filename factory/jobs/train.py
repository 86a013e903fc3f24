"""``factory.train``: train a blueprint's model (or its CPU proxy) on its data recipe.

The blueprint's optimizer, schedule, batch, precision policy and stability
monitors (``factory.runtime``), on one process or on the blueprint's parallel
layout: every process of a ``torchrun`` launch runs this same job, and a run on
one process is world size 1 of the same code. The run folder holds:

* ``data/``: the curated shards it trains on (not when ``data`` is given),
  built whole by rank 0 before training starts and checked again on every rerun
  (the folder must be on storage every rank sees);
* ``run.json``: what it trains (the blueprint, precision backend, seed and data folder),
  written once the run starts or resumes, before its first step, so ``factory eval`` reads any of its checkpoints;
* ``checkpoints/``: resumable checkpoints every ``checkpoint_every`` steps and
  at the end, each complete or absent (``factory.runtime.checkpoint``; DCP,
  written by all ranks together);
* ``metrics.jsonl``: one record per step, monitor event, checkpoint and
  rollback, flushed as it goes (every rank but 0 writes ``ranks/rank_NNNNN.jsonl``);
* at the end, ``train.json`` (what ran, one record per step), ``model/`` (a
  Hugging Face checkpoint that transformers and ``factory import hf`` load,
  gathered from the ranks' shards on rank 0) and ``report/report.html``
  (``factory report``), each written whole by rank 0;
* ``averaged/``: averaged checkpoints (``factory.jobs.average``): ``ema/`` at the end with
  ``training.average``, others as ``factory average`` writes them.

Rerunning into the same folder (or ``resume=True``, which insists) continues
from the latest complete checkpoint, exactly as the uninterrupted run would; a
rerun of a run that completed all its steps changes nothing and says so
(:attr:`TrainResult.found_complete_at`).
What cannot run is refused by :func:`prepare_training` before any work: a model
whose fp32 weights, gradients and Adam states would not fit this machine's
memory (:class:`ModelTooBig`), a backend that is not installed, a launch that
does not fit the layout (``factory.jobs.launch``), a held-out set ``training.eval`` names
that the data build lacks. The request every rank carries and
the result are ``factory.jobs.train_request``'s; the refusals ``factory.jobs.train_errors``'.
"""

from __future__ import annotations

import os
import typing
from collections.abc import Callable
from pathlib import Path

from factory.jobs.launch import LaunchRefused, check_launch, launched_world_size
from factory.jobs.train_errors import (
    BYTES_PER_PARAM,
    BackendUnavailable,
    CannotLaunch,
    ModelTooBig,
)
from factory.jobs.train_program import ProgramRequest, ProgramResult, plan_stages, run_program
from factory.jobs.train_request import (
    CheckpointPolicy,
    StageRun,
    StepsShown,
    TrainRequest,
    TrainResult,
    TrainSettings,
    evaluated_sets,
    ignore_notice,
)
from factory.planner.params import count_params
from factory.precision.backends import PrecisionBackend, require_te
from factory.progress import Progress, silent
from factory.proxy_layout import derive_proxy_layout
from factory.runtime.loggers import require_loggers
from factory.schemas.blueprint import Blueprint

__all__ = ["checked_request", "prepare_program", "prepare_training", "run_training", "train"]


def prepare_training(
    blueprint: Blueprint,
    settings: TrainSettings,
    *,
    proxy: bool = False,
    precision: PrecisionBackend = "auto",
    world_size: int | None = None,
) -> TrainRequest:
    """The training of ``blueprint`` (its CPU proxy laid out on ``world_size`` ranks with
    ``proxy=True``) on ``world_size`` processes (default: this launch's) with ``settings``,
    checked.

    Raises :class:`CannotLaunch`, :class:`ModelTooBig` or :class:`BackendUnavailable` (also
    for a tracker of ``training.loggers`` that is not installed), and
    ``ValueError`` for a precision backend that does not exist. On several processes the launch is checked first (the layout must fit
    them); on one, the model's size (a model too big for one process says to train its
    proxy).
    """
    if blueprint.stages is not None:
        raise ValueError(
            f"{blueprint.meta.name} is a program of stages: factory.jobs.train_program's "
            "prepare_program trains it"
        )
    world = launched_world_size() if world_size is None else world_size
    bp, changes = derive_proxy_layout(blueprint, world) if proxy else (blueprint, [])
    return checked_request(bp, changes, settings, proxy=proxy, precision=precision, world=world)


def checked_request(
    bp: Blueprint,
    changes: list[str],
    settings: TrainSettings,
    *,
    proxy: bool,
    precision: PrecisionBackend,
    world: int,
    stage: StageRun | None = None,
) -> TrainRequest:
    """The request to train ``bp`` (already the proxy's, laid out, where ``proxy``) on
    ``world`` processes, or the refusal :func:`prepare_training` describes."""
    backends = typing.get_args(PrecisionBackend)
    if precision not in backends:
        raise ValueError(f"precision must be one of {', '.join(backends)}, not {precision!r}")
    if world > 1:  # several processes were asked for: the layout must fit them first
        _check_launch(bp, world, precision)
    if precision == "te":
        try:
            require_te()
        except ImportError as exc:
            raise BackendUnavailable(str(exc)) from exc
    try:
        require_loggers(bp.training.loggers)
    except ImportError as exc:
        raise BackendUnavailable(str(exc)) from exc
    params, have = count_params(bp.model).total, _memory_bytes()
    if have and params * BYTES_PER_PARAM > have:
        raise ModelTooBig(bp.meta.name, params, have, proxy)
    if world == 1:  # after the size: a model too big for one process says to train its proxy
        _check_launch(bp, world, precision)
    if settings.data is not None:  # else the recipe's build, checked once it is built
        evaluated_sets(bp, settings.data)
    return TrainRequest(bp, precision, tuple(changes), settings, stage)


def prepare_program(
    blueprint: Blueprint,
    settings: TrainSettings,
    *,
    proxy: bool = False,
    precision: PrecisionBackend = "auto",
    world_size: int | None = None,
    stage: str | None = None,
) -> ProgramRequest:
    """The training of ``blueprint``'s program of stages (``factory.jobs.train_program``),
    every stage or ``stage`` alone, each checked as :func:`prepare_training` checks a
    blueprint, before any of them runs.

    Raises what :func:`prepare_training` raises (a :class:`CannotLaunch` placed where the
    blueprint file writes the value: ``stages[i].parallelism...`` for a stage's own) and
    :class:`~factory.jobs.train_program.StageRefused`.
    """
    world = launched_world_size() if world_size is None else world_size
    plan = plan_stages(blueprint, settings, proxy=proxy, world=world, stage=stage)
    program, out, steps, planned = plan
    requests = []
    for one in planned:
        try:
            request = checked_request(
                one.blueprint, one.changes, one.settings,
                proxy=proxy, precision=precision, world=world, stage=one.stage,
            )  # fmt: skip
        except CannotLaunch as exc:
            where = one.source.document_path(exc.path)
            raise CannotLaunch(f"stage {one.stage.name}: {exc}", where, exc.rule) from exc
        requests.append(request)
    return ProgramRequest(blueprint, out, tuple(program.names), tuple(steps), tuple(requests))


def _check_launch(bp: Blueprint, world: int, precision: PrecisionBackend) -> None:
    try:
        check_launch(bp, world, precision)
    except LaunchRefused as exc:
        raise CannotLaunch(str(exc), exc.path, exc.rule) from exc


def _memory_bytes() -> int:
    """Physical memory of this machine (0 where the OS does not say)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 0


def train(
    blueprint: Blueprint,
    *,
    out: Path | None = None,
    proxy: bool = False,
    steps: int | None = None,
    data: Path | None = None,
    precision: PrecisionBackend = "auto",
    seed: int | None = None,
    workers: int = 1,
    progress: Progress | None = None,
    show_steps: StepsShown = None,
    checkpoints: CheckpointPolicy | None = None,
    notice: Callable[[str], None] | None = None,
    stage: str | None = None,
) -> TrainResult | ProgramResult:
    """Train ``blueprint`` (its CPU proxy with ``proxy=True``) and write ``out``.

    :func:`prepare_training` then :func:`run_training`; the keywords besides ``proxy``,
    ``precision`` and ``stage`` are :class:`~factory.jobs.train_request.TrainSettings`'. A
    blueprint with ``stages`` trains its program (``factory.jobs.train_program``), every
    stage or, with ``stage``, that one, and returns a
    :class:`~factory.jobs.train_program.ProgramResult`.
    """
    settings = TrainSettings(
        out=out,
        steps=steps,
        data=data,
        seed=seed,
        workers=workers,
        progress=progress or silent,
        show_steps=show_steps,
        checkpoints=checkpoints or CheckpointPolicy(),
        notice=notice or ignore_notice,
    )
    if blueprint.stages is not None:
        request = prepare_program(
            blueprint, settings, proxy=proxy, precision=precision, stage=stage
        )
        return run_program(request)
    if stage is not None:
        raise ValueError(f"stage {stage!r}: {blueprint.meta.name} has no stages")
    return run_training(prepare_training(blueprint, settings, proxy=proxy, precision=precision))


def run_training(request: TrainRequest) -> TrainResult:
    """Train on this process's share of the layout and write the run folder.

    The run folder holds what this module's docstring lists; a rerun into it resumes, or
    finds the run complete and changes nothing.

    Raises :class:`~factory.jobs.run_lock.RunFolderBusy` while another training holds
    the run folder, :class:`~factory.jobs.train_errors.CannotResume` or
    :class:`~factory.jobs.train_errors.BadData` before any step,
    :class:`~factory.runtime.checkpoint_errors.CheckpointWriteError` (an ``OSError``) when a
    checkpoint cannot be written, and :class:`~factory.jobs.train_errors.RankLost` when
    another rank dies. A SIGTERM or SIGINT ends the run at the next step with a checkpoint:
    its history ends ``interrupted``, naming the signal.
    """
    # This rank's share of the work imports torch: ``factory.train`` resolves without it.
    from factory.jobs.train_rank import run_rank

    return run_rank(request)
