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
does not fit the layout (``factory.jobs.launch``).
"""

from __future__ import annotations

import dataclasses
import os
import typing
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from factory.jobs.launch import LaunchRefused, check_launch, launched_world_size
from factory.planner.params import count_params
from factory.precision.backends import PRECISION_OFF, PrecisionBackend, require_te
from factory.precision.policy import uses_low_precision
from factory.progress import Progress, silent
from factory.proxy_layout import derive_proxy_layout
from factory.runtime.checkpoint_errors import CheckpointWriteError
from factory.runtime.loggers import require_loggers
from factory.schemas.blueprint import Blueprint

if TYPE_CHECKING:
    from factory.runtime.history import RunHistory, StepRecord

__all__ = [
    "BackendUnavailable",
    "BadData",
    "CannotLaunch",
    "CannotResume",
    "CheckpointPolicy",
    "CheckpointWriteError",
    "ModelTooBig",
    "RankLost",
    "StepsShown",
    "TrainRefused",
    "TrainRequest",
    "TrainResult",
    "prepare_training",
    "train",
]

StepsShown = Literal["rich", "plain"] | None
"""How the trainer shows its steps itself: a live rich bar, timestamped log lines, or not at
all (None: the steps go to the ``progress`` callback as stage ``train``)."""

BYTES_PER_PARAM = 16
"""fp32 weight + gradient + two Adam moments: what one process holds per parameter."""


class TrainRefused(Exception):
    """A training request this machine cannot run; nothing was written (the CLI exits 2)."""


class ModelTooBig(TrainRefused):
    """The model's training state needs more memory than this machine has."""

    def __init__(self, name: str, params: int, have_bytes: int, proxy: bool) -> None:
        self.params, self.need_bytes, self.have_bytes = params, params * BYTES_PER_PARAM, have_bytes
        hint = "" if proxy else "; train its CPU proxy (proxy=True, or --proxy)"
        super().__init__(
            f"{name} has {params:,} parameters, whose fp32 weights, gradients and Adam states "
            f"need {self.need_bytes / 2**30:,.0f} GiB, more than this machine's "
            f"{have_bytes / 2**30:,.0f} GiB{hint}"
        )


class BackendUnavailable(TrainRefused, ImportError):
    """The requested precision backend is not installed (Transformer Engine, for ``te``), or
    the package of a tracker ``training.loggers`` names (tensorboard, wandb)."""


class CannotResume(TrainRefused):
    """Nothing to resume, a checkpoint of another model, or one that cannot be read."""


class CannotLaunch(TrainRefused):
    """The launch does not fit the blueprint's layout, or runs what factory's runtime does not
    (``factory.jobs.launch``); refused before any process group is made. ``path`` is the
    blueprint field at fault."""

    def __init__(self, message: str, path: str) -> None:
        super().__init__(message)
        self.path = path


class RankLost(RuntimeError):
    """A collective failed mid-run: another rank died or stopped answering (the CLI exits 1)."""


class BadData(TrainRefused):
    """The data folder does not match its manifest (missing, truncated or changed shards)."""


@dataclasses.dataclass(frozen=True)
class CheckpointPolicy:
    """When and how checkpoints are written and whether the run must resume from one."""

    every: int | None = None
    """Steps between checkpoints (default: the blueprint's ``training.checkpoint_interval``)."""
    keep: int = 3
    """Complete checkpoints kept (a rollback needs one from before the trouble)."""
    async_save: bool = False
    """Write checkpoints in the background while training goes on."""
    resume: bool = False
    """Insist on resuming (an error when the folder has no complete checkpoint). Without it a
    folder that has one resumes anyway, and one that has none starts afresh."""


@dataclasses.dataclass(frozen=True)
class TrainResult:
    """What :func:`train` ran and wrote."""

    out: Path
    """The run folder (absolute): train.json, model/ and, unless data was given, data/."""
    blueprint: Blueprint
    """The blueprint that trained: the proxy's with ``proxy=True``."""
    device: str
    precision: dict[str, int]
    """Linears per recipe as installed (empty with precision="off")."""
    seed: int
    data: Path
    """The shards it trained on."""
    history: RunHistory
    """The trainer's records (one per optimizer step) and how the run ended."""
    found_complete_at: int | None = None
    """The step a rerun found the run folder's training complete at, having changed nothing
    (``history`` is then ``train.json``'s); None when this call trained."""

    @property
    def records(self) -> list[StepRecord]:
        return self.history.records

    @property
    def diverged(self) -> bool:
        return self.history.diverged


def prepare_training(
    blueprint: Blueprint,
    *,
    proxy: bool = False,
    precision: PrecisionBackend = "auto",
    world_size: int | None = None,
) -> TrainRequest:
    """The training of ``blueprint`` (its CPU proxy laid out on ``world_size`` ranks with
    ``proxy=True``) on ``world_size`` processes (default: this launch's), checked.

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
        _check_launch(bp, world)
    if bp.training.compile and precision != "off" and uses_low_precision(bp):
        raise ValueError(f"{PRECISION_OFF}; run with --precision off or training.compile: false")
    if precision == "te" and bp.parallelism.tp > 1 and uses_low_precision(bp):
        raise CannotLaunch(
            f"--precision te with parallelism.tp={bp.parallelism.tp}: factory does not split "
            "Transformer Engine's linears yet; use --precision emulate (auto does under TP), "
            "or --set parallelism.tp=1",
            "parallelism.tp",
        )
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
    _check_launch(bp, world)
    return TrainRequest(bp, precision, tuple(changes))


def _check_launch(bp: Blueprint, world: int) -> None:
    try:
        check_launch(bp, world)
    except LaunchRefused as exc:
        raise CannotLaunch(str(exc), exc.path) from exc


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

    :func:`prepare_training` then :meth:`TrainRequest.run`; see both.
    """
    request = prepare_training(blueprint, proxy=proxy, precision=precision)
    return request.run(
        out=out,
        steps=steps,
        data=data,
        seed=seed,
        workers=workers,
        progress=progress,
        show_steps=show_steps,
        checkpoints=checkpoints,
        notice=notice,
    )


@dataclasses.dataclass(frozen=True)
class TrainRequest:
    """A training that :func:`prepare_training` accepted; :meth:`run` does it."""

    blueprint: Blueprint
    """The blueprint that trains (the proxy's, laid out on the launch, with ``proxy``)."""
    precision: PrecisionBackend
    layout_changes: tuple[str, ...] = ()
    """What the proxy's layout changed to fit the launch (``factory.proxy_layout``)."""

    def run(
        self,
        *,
        out: Path | None = None,
        steps: int | None = None,
        data: Path | None = None,
        seed: int | None = None,
        workers: int = 1,
        progress: Progress | None = None,
        show_steps: StepsShown = None,
        checkpoints: CheckpointPolicy | None = None,
        notice: Callable[[str], None] | None = None,
    ) -> TrainResult:
        """Train on this process's share of the layout and write the run folder.

        ``out`` defaults to ``runs/NAME``; ``steps`` to the blueprint's; ``seed`` to
        ``training.seed``. ``data`` trains on shards built already instead of building the
        recipe (with ``workers`` processes) at the blueprint's ``data.seq_len``.
        ``progress`` gets the data build's stages, ``compile``, ``train`` (optimizer steps)
        and ``export``; ``show_steps`` lets the trainer show each step's loss, learning rate,
        gradient norm, tokens/s and ETA itself instead of reporting ``train``: ``"rich"`` a
        live bar, ``"plain"`` a timestamped line every ``PLAIN_EVERY_STEPS`` steps or
        ``PLAIN_EVERY_S`` seconds (``factory.progress``). ``checkpoints`` sets the cadence and resume
        behaviour. ``notice`` is told, a line at a time, what the run repaired or skipped
        (a damaged checkpoint passed over for an older one, a torn line of metrics.jsonl).

        Raises :class:`~factory.jobs.run_lock.RunFolderBusy` while another training holds
        ``out``, :class:`CannotResume` or :class:`BadData` before any step,
        :class:`CheckpointWriteError` (an ``OSError``) when a checkpoint cannot be written,
        and :class:`RankLost` when another rank dies. A SIGTERM or SIGINT ends the run at the
        next step with a checkpoint: its history ends ``interrupted``, naming the signal.
        """
        # This rank's share of the work imports torch: ``factory.train`` resolves without it.
        from factory.jobs.train_rank import run_rank

        return run_rank(
            self,
            out=self.run_folder(out),
            steps=steps,
            data=data,
            seed=self.blueprint.training.seed if seed is None else seed,
            workers=workers,
            progress=progress or silent,
            show_steps=show_steps,
            checkpoints=checkpoints or CheckpointPolicy(),
            notice=notice or _ignore,
        )

    def run_folder(self, out: Path | None) -> Path:
        """The run folder :meth:`run` writes for ``out`` (default ``runs/NAME``), absolute."""
        return (out or Path("runs") / self.blueprint.meta.name).resolve()


def _ignore(line: str) -> None:
    """The default notice: the caller did not ask to be told."""
