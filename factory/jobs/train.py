"""``factory.train``: train a blueprint's model (or its CPU proxy) on its data recipe.

The blueprint's optimizer, schedule, batch, precision policy and stability
monitors (``factory.runtime``), on one process or on the blueprint's parallel
layout: every process of a ``torchrun`` launch runs this same job, and a run on
one process is world size 1 of the same code. The run folder holds:

* ``data/``: the curated shards it trains on (not when ``data`` is given),
  built whole by rank 0 before training starts and checked again on every rerun
  (the folder must be on storage every rank sees);
* ``checkpoints/``: resumable checkpoints every ``checkpoint_every`` steps and
  at the end, each complete or absent (``factory.runtime.checkpoint``; DCP,
  written by all ranks together);
* ``metrics.jsonl``: one record per step, monitor event, checkpoint and
  rollback, flushed as it goes (every rank but 0 writes ``ranks/rank_NNNNN.jsonl``);
* at the end, ``train.json`` (what ran, one record per step), ``model/`` (a
  Hugging Face checkpoint that transformers and ``factory import hf`` load,
  gathered from the ranks' shards on rank 0) and ``report/report.html``
  (``factory report``), each written whole by rank 0.

Rerunning into the same folder (or ``resume=True``, which insists) continues
from the latest complete checkpoint, exactly as the uninterrupted run would; a
rerun of a run that completed all its steps changes nothing and says so
(:attr:`TrainResult.found_complete_at`).
What cannot run is refused by :func:`prepare_training` before any work: a model
whose fp32 weights, gradients and Adam states would not fit this machine's
memory (:class:`ModelTooBig`), a backend that is not installed, a launch that
does not fit the layout (``factory.jobs.launch``). The request every rank carries and
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
from factory.jobs.train_request import (
    CheckpointPolicy,
    StepsShown,
    TrainRequest,
    TrainResult,
    TrainSettings,
    ignore_notice,
)
from factory.planner.params import count_params
from factory.precision.backends import PRECISION_OFF, PrecisionBackend, require_te
from factory.precision.policy import uses_low_precision
from factory.progress import Progress, silent
from factory.proxy_layout import derive_proxy_layout
from factory.runtime.loggers import require_loggers
from factory.schemas.blueprint import Blueprint

__all__ = ["prepare_training", "run_training", "train"]


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
    ``ValueError`` for a precision backend that does not exist or one training.compile
    cannot take. On several processes the launch is checked first (the layout must fit
    them); on one, the model's size (a model too big for one process says to train its
    proxy).
    """
    world = launched_world_size() if world_size is None else world_size
    backends = typing.get_args(PrecisionBackend)
    if precision not in backends:
        raise ValueError(f"precision must be one of {', '.join(backends)}, not {precision!r}")
    bp, changes = derive_proxy_layout(blueprint, world) if proxy else (blueprint, [])
    if world > 1:  # several processes were asked for: the layout must fit them first
        _check_launch(bp, world, precision)
    if bp.training.compile and precision != "off" and uses_low_precision(bp):
        raise ValueError(f"{PRECISION_OFF}; run with --precision off or training.compile: false")
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
    return TrainRequest(bp, precision, tuple(changes), settings)


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
) -> TrainResult:
    """Train ``blueprint`` (its CPU proxy with ``proxy=True``) and write ``out``.

    :func:`prepare_training` then :func:`run_training`; the keywords besides ``proxy`` and
    ``precision`` are :class:`~factory.jobs.train_request.TrainSettings`'.
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
