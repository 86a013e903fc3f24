"""The trainer's hooks: what a callback may watch, record and decide, in the order the trainer calls them.

The trainer (``factory.runtime.trainer``) runs the step; everything else a run
does happens in callbacks, as in OLMo-core: the stability monitors
(``factory.runtime.monitors``), ``metrics.jsonl`` (``factory.runtime.metrics``),
the progress display (``factory.runtime.display``), checkpoints every
``checkpoint_interval`` steps (:class:`PeriodicCheckpoint`) and, in the training
job, the run report. Callbacks run in list order at every hook, on every rank
(each decides what its rank writes).

One hook decides: :meth:`Callback.check_step` sees the step's statistics before
the optimizer applies it and returns a :class:`Verdict`. The trainer merges
every callback's verdict, takes the most severe action (``continue``,
``rollback`` or ``stop``), agrees on it across ranks and carries it out:
stopping and rolling back are the trainer's own operations.

A callback with state that must survive a resume names it with ``state_key``:
the trainer stores :meth:`Callback.state_dict` in each checkpoint's
``meta.json`` under that key and hands it back on resume and rollback.

A callback sees the trainer as a :class:`TrainerView`: what a callback may read
and call. The trainer satisfies it, and neither module imports the other.

This module does not import torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

if TYPE_CHECKING:
    from factory.compilation import Compiled
    from factory.runtime.history import RunHistory, StepRecord
    from factory.runtime.ranks import Ranks
    from factory.runtime.run_options import RunOptions
    from factory.runtime.run_state import Position
    from factory.runtime.step import StepOutcome

__all__ = [
    "SEVERITY",
    "Callback",
    "Event",
    "HeldoutMetrics",
    "PeriodicCheckpoint",
    "Rollback",
    "StepStats",
    "TrainerView",
    "Verdict",
    "verdict",
]

SEVERITY = {"warn": 0, "rollback": 1, "stop": 2}
"""When events disagree, the most severe action wins: a stop the user asked for is never
turned into a rollback."""


@dataclass(frozen=True)
class StepStats:
    update: int
    """Monotone count of optimizer updates attempted (also across rollbacks)."""
    step: int
    """The schedule's step."""
    loss: float
    grad_norm: float
    finite: bool
    """Loss, gradients and parameters are all finite."""
    max_vio: dict[str, float] = field(default_factory=dict)
    residual_rms: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Event:
    update: int
    step: int
    monitor: str
    action: str
    message: str
    value: float | None = None
    threshold: float | None = None
    layer: str | None = None


@dataclass(frozen=True)
class HeldoutMetrics:
    """One held-out set's loss at an evaluation (``factory.runtime.validation``); one record
    per set and one for all of them together (``category`` null)."""

    update: int
    step: int
    """The steps applied before the evaluation."""
    category: str | None
    loss: float
    """Mean next-token cross-entropy over the set's loss-masked targets (nats)."""
    perplexity: float
    tokens: int
    """The targets averaged over."""
    mtp_losses: dict[str, float]
    """MTP depth (``"1"``, ``"2"``, ...) to its mean cross-entropy; empty without MTP."""


def verdict(events: list[Event]) -> str:
    """'continue', or the most severe non-warn action among ``events``."""
    worst = max((SEVERITY[e.action] for e in events), default=0)
    return "continue" if worst == 0 else next(a for a, s in SEVERITY.items() if s == worst)


@dataclass(frozen=True)
class Verdict:
    """What a callback makes of a step before it is applied."""

    events: tuple[Event, ...] = ()
    """What it saw; each event carries its configured action (``warn``, ``rollback``,
    ``stop``)."""
    rollback_before: int | None = None
    """With a rollback: the step at which the trouble began (the trainer goes back to the
    newest checkpoint up to that step); None: the current step."""

    @property
    def action(self) -> str:
        """``continue``, or the most severe non-warn action of the events."""
        return verdict(list(self.events))

    def merged(self, other: Verdict) -> Verdict:
        """Both callbacks' events; the earlier start of trouble."""
        starts = [s for s in (self.rollback_before, other.rollback_before) if s is not None]
        return Verdict(self.events + other.events, min(starts) if starts else None)


@dataclass(frozen=True)
class Rollback:
    """A rollback the trainer made: back from ``from_step`` to the checkpoint at ``to_step``."""

    update: int
    from_step: int
    to_step: int
    skipped_samples: int
    """The data between the checkpoint and the refused step, which is not replayed."""
    anneal_steps: int


class TrainerView(Protocol):
    """The trainer (``factory.runtime.trainer.Trainer``) as its callbacks see it."""

    compiled: Compiled
    steps: int
    """The schedule step the run trains to."""
    position: Position
    ranks: Ranks
    options: RunOptions
    history: RunHistory

    def save(self) -> None:
        """Checkpoint the run as it stands (nothing without a run folder)."""

    def evaluated(self, records: list[HeldoutMetrics]) -> None:
        """Hand an evaluation's records to every callback's :meth:`Callback.on_evaluation`."""


class Callback:
    """Base class: every hook does nothing. Override what the callback needs."""

    state_key: ClassVar[str | None] = None
    """Where this callback's state goes in a checkpoint's ``meta.json`` (None: it has none)."""

    def pre_train(self, trainer: TrainerView) -> None:
        """Before the first step (after a resume has put the run at its position)."""

    def check_step(self, trainer: TrainerView, stats: StepStats) -> Verdict:
        """After the step's backward pass and gradient norm, before the optimizer applies it."""
        return Verdict()

    def on_event(self, trainer: TrainerView, event: Event) -> None:
        """Each event of the merged verdict, before the trainer acts on it."""

    def on_rollback(self, trainer: TrainerView, rollback: Rollback) -> None:
        """After the trainer went back to a checkpoint."""

    def post_step(self, trainer: TrainerView, record: StepRecord, outcome: StepOutcome) -> None:
        """After an optimizer step was applied (``trainer.position`` is past it)."""

    def on_evaluation(self, trainer: TrainerView, records: list[HeldoutMetrics]) -> None:
        """After an evaluation on the held-out sets (``training.eval``): one record per set
        and one for all of them, the same on every rank."""

    def on_checkpoint(self, trainer: TrainerView, path: Path, seconds: float) -> None:
        """After a checkpoint write was issued (complete unless written asynchronously)."""

    def post_train(self, trainer: TrainerView, history: RunHistory) -> None:
        """After the run ended, completed or not, and its last checkpoint is complete."""

    def close(self, trainer: TrainerView) -> None:
        """Always, last, also when the run failed: release what the callback holds."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take back what :meth:`state_dict` gave, from a checkpoint."""


class PeriodicCheckpoint(Callback):
    """A checkpoint every ``every`` steps (the last step's comes from the trainer itself)."""

    def __init__(self, every: int) -> None:
        if every < 1:
            raise ValueError(f"checkpoints every {every} steps: must be at least 1")
        self.every = every

    def post_step(self, trainer: TrainerView, record: StepRecord, outcome: StepOutcome) -> None:
        step = trainer.position.step
        if step % self.every == 0 and step < trainer.steps:
            trainer.save()
