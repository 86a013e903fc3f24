"""A training as ``factory.train`` carries it to every rank, and what it ran.

:func:`~factory.jobs.train.prepare_training` checks a blueprint and
:class:`TrainSettings` (where the run goes and how it is shown) into one frozen
:class:`TrainRequest`; every process of a launch trains that same object
(``factory.jobs.train_rank``) and returns a :class:`TrainResult`. Torch-free.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from factory.data.shards.heldout import heldout_sets
from factory.data.shards.manifest import ManifestError
from factory.jobs.train_errors import CannotLaunch
from factory.precision.backends import PrecisionBackend
from factory.progress import Progress, silent
from factory.schemas.blueprint import Blueprint

if TYPE_CHECKING:
    from factory.runtime.history import RunHistory, StepRecord

__all__ = [
    "RUN_FILE",
    "CheckpointPolicy",
    "StageRun",
    "StepsShown",
    "TrainRequest",
    "TrainResult",
    "TrainSettings",
    "evaluated_sets",
    "ignore_notice",
]

RUN_FILE = "run.json"
"""What a run folder trains, written when it starts: ``blueprint`` (the blueprint that trains,
as JSON), ``precision`` (the backend), ``seed`` and ``data`` (the shards' folder)."""

StepsShown = Literal["rich", "plain"] | None
"""How the trainer shows its steps itself: a live rich bar, timestamped log lines, or not at
all (None: the steps go to the ``progress`` callback as stage ``train``)."""


def evaluated_sets(blueprint: Blueprint, data: Path) -> dict[str, Path]:
    """The held-out sets ``training.eval`` evaluates in the data build at ``data``, category
    to built folder (none without ``training.eval``). Raises :class:`CannotLaunch` naming
    ``training.eval.sets`` for a set the build lacks, or a build with none."""
    evaluation = blueprint.training.eval
    if evaluation is None:
        return {}
    try:
        found = heldout_sets(data)
    except ManifestError as exc:
        raise CannotLaunch(f"training.eval: {exc}", "training.eval.sets") from exc
    have = ", ".join(found) or "none"
    if not found:
        raise CannotLaunch(
            f"training.eval: the data build {data} has no held-out sets (its manifest lists "
            "no 'heldout'); give its recipe's sources a held-out split, or leave training.eval "
            "out",
            "training.eval.sets",
        )
    wanted = evaluation.sets or tuple(found)
    missing = [name for name in wanted if name not in found]
    if missing:
        raise CannotLaunch(
            f"training.eval.sets: the data build {data} has no held-out set "
            f"{', '.join(map(repr, missing))}; it has {have}",
            "training.eval.sets",
        )
    return {name: found[name].folder for name in wanted}


def ignore_notice(line: str) -> None:
    """The default notice: the caller did not ask to be told."""


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


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainSettings:
    """Where a training writes, what it trains on and how it reports: everything
    ``factory.train`` takes besides the blueprint, ``proxy`` and ``precision``."""

    out: Path | None = None
    """The run folder (default ``runs/NAME``)."""
    steps: int | None = None
    """Optimizer steps (default: the blueprint's)."""
    data: Path | None = None
    """Shards built already, trained on instead of building the recipe."""
    seed: int | None = None
    """Default ``training.seed``."""
    workers: int = 1
    """Processes that build the recipe's shards (at the blueprint's ``data.seq_len``)."""
    progress: Progress = silent
    """Told the data build's stages, ``compile``, ``train`` (optimizer steps) and
    ``export``."""
    show_steps: StepsShown = None
    """The trainer shows each step's loss, learning rate, gradient norm, tokens/s and ETA
    itself instead of reporting ``train``: ``"rich"`` a live bar, ``"plain"`` a timestamped
    line every ``PLAIN_EVERY_STEPS`` steps or ``PLAIN_EVERY_S`` seconds
    (``factory.progress``)."""
    checkpoints: CheckpointPolicy = CheckpointPolicy()
    """The cadence of checkpoints and whether the run must resume."""
    notice: Callable[[str], None] = ignore_notice
    """Told, a line at a time, what the run repaired or skipped (a damaged checkpoint passed
    over for an older one, a torn line of metrics.jsonl)."""


@dataclasses.dataclass(frozen=True)
class StageRun:
    """A training that is one stage of a program (``factory.jobs.train_program``): where it
    sits in the program and in its learning-rate schedule, and where it starts."""

    name: str
    index: int
    schedule_offset: int
    """Steps of the schedule that earlier stages took (``ProgramStage.schedule_offset``)."""
    schedule_steps: int
    """Steps the schedule spans (``ProgramStage.schedule_steps``)."""
    previous: Path | None
    """The boundary checkpoint of the stage before (None: the first stage), which the stage
    starts from when it has no checkpoint of its own."""
    carry_optimizer: bool = True
    carry_data_position: bool = False


@dataclasses.dataclass(frozen=True)
class TrainRequest:
    """A training that :func:`~factory.jobs.train.prepare_training` accepted."""

    blueprint: Blueprint
    """The blueprint that trains (the proxy's, laid out on the launch, with ``proxy``)."""
    precision: PrecisionBackend
    layout_changes: tuple[str, ...] = ()
    """What the proxy's layout changed to fit the launch (``factory.proxy_layout``)."""
    settings: TrainSettings = TrainSettings()
    stage: StageRun | None = None
    """The stage of a program this training is (None: a blueprint without stages)."""

    @property
    def out(self) -> Path:
        """The run folder, absolute."""
        return (self.settings.out or Path("runs") / self.blueprint.meta.name).resolve()

    @property
    def seed(self) -> int:
        return self.blueprint.training.seed if self.settings.seed is None else self.settings.seed


@dataclasses.dataclass(frozen=True)
class TrainResult:
    """What ``factory.train`` ran and wrote."""

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
    kernels: tuple[str, ...] = ()
    """The run's kernel report as its first lines printed it (``factory.runtime.run_kernels``):
    which kernel each layer type runs, whether its blocks are compiled, each fallback's
    reason."""

    @property
    def records(self) -> list[StepRecord]:
        return self.history.records

    @property
    def diverged(self) -> bool:
        return self.history.diverged
