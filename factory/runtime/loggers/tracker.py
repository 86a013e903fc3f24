"""What every experiment tracker records: the trainer's hooks as scalars and notes at a step.

A :class:`Tracker` turns the records ``metrics.jsonl`` holds into what a tracker
shows: each applied step's numbers as scalars (:func:`step_scalars`), a monitor
event as a scalar per monitor and a line of text, a checkpoint and a rollback
likewise. Subclasses say only how a scalar and a note are written, and what a
rollback means to their history (:meth:`Tracker.rewind`: TensorBoard hides the
steps the run went back over, so its curves show the steps the run kept; the
events that caused the rollback are written again after it, so they stay). The
x-axis is the schedule's step, the ``step`` of ``metrics.jsonl``. This module
does not import torch.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from factory.runtime.callbacks import Callback, Event, HeldoutMetrics, Rollback, TrainerView
from factory.runtime.metrics import StepMetrics, step_metrics

if TYPE_CHECKING:
    from factory.runtime.history import RunHistory, StepRecord
    from factory.runtime.step import StepOutcome

__all__ = ["STEP_SCALARS", "Tracker", "event_scalar", "heldout_scalars", "step_scalars"]

STEP_SCALARS = ("loss", "lm_loss", "lr", "grad_norm", "tokens_per_s", "tokens_seen", "seconds")
"""The fields of a ``step`` record shown as scalars of the same name; per-layer MaxVio and
residual RMS follow as ``max_vio/<layer>`` and ``residual_rms/<layer>``."""


def step_scalars(metrics: StepMetrics) -> dict[str, float]:
    """The scalars of one applied step, named as in ``metrics.jsonl``."""
    values = {name: float(getattr(metrics, name)) for name in STEP_SCALARS}
    values.update({f"max_vio/{layer}": v for layer, v in metrics.max_vio.items()})
    values.update({f"residual_rms/{layer}": v for layer, v in metrics.residual_rms.items()})
    return values


def event_scalar(event: Event) -> dict[str, float]:
    """``events/<monitor>``: the value that crossed the threshold (1 where the monitor has
    none, such as a non-finite loss), so each monitor's alarms line up with the loss."""
    return {f"events/{event.monitor}": 1.0 if event.value is None else float(event.value)}


def heldout_scalars(record: HeldoutMetrics) -> dict[str, float]:
    """``heldout/<category>/loss``, ``.../perplexity`` and ``.../mtp_<depth>`` of one set
    (``heldout/loss`` ... for all sets together), beside the training ``loss``."""
    prefix = "heldout" if record.category is None else f"heldout/{record.category}"
    values = {f"{prefix}/loss": record.loss, f"{prefix}/perplexity": record.perplexity}
    values.update({f"{prefix}/mtp_{depth}": v for depth, v in record.mtp_losses.items()})
    return values


class Tracker(Callback):
    """Rank 0's records for one experiment tracker (the registry makes it only there)."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.completed = False
        """post_train ran: the run ended on its own terms (completed, stopped, interrupted)."""
        self._step_events: list[Event] = []
        """The events of the step in flight, written again if it is rolled back."""

    def open(self, trainer: TrainerView) -> None:
        """Start writing; ``trainer.position`` is where the run starts (after a resume)."""

    def scalars(self, step: int, values: dict[str, float]) -> None:
        raise NotImplementedError

    def note(self, step: int, tag: str, text: str) -> None:
        raise NotImplementedError

    def rewind(self, step: int) -> None:
        """The run went back to ``step``: what was written at it and after is superseded by
        what follows."""

    def shut(self) -> None:
        """Finish writing (always called, also after a failure; see ``completed``)."""

    def pre_train(self, trainer: TrainerView) -> None:
        self.open(trainer)
        stage = getattr(trainer.options, "stage", None)  # views made by hand may lack it
        if stage is not None:
            self.note(trainer.position.step, "run", f"stage {stage}")
        if trainer.position.step:
            self.note(trainer.position.step, "run", f"resumed at step {trainer.position.step}")

    def post_step(self, trainer: TrainerView, record: StepRecord, outcome: StepOutcome) -> None:
        self._step_events.clear()
        self.scalars(record.step, step_scalars(step_metrics(record, outcome)))
        if record.switched_to_bf16:
            self.note(record.step, "run", f"precision switched to BF16 after step {record.step}")

    def on_event(self, trainer: TrainerView, event: Event) -> None:
        self._step_events.append(event)
        self._write_event(event)

    def _write_event(self, event: Event) -> None:
        self.scalars(event.step, event_scalar(event))
        text = f"{event.monitor} ({event.action}) at step {event.step}: {event.message}"
        self.note(event.step, "events", text)

    def on_evaluation(self, trainer: TrainerView, records: list[HeldoutMetrics]) -> None:
        for record in records:
            self.scalars(record.step, heldout_scalars(record))

    def on_checkpoint(self, trainer: TrainerView, path: Path, seconds: float) -> None:
        step = trainer.position.step
        self.scalars(step, {"checkpoint/seconds": seconds})
        self.note(step, "checkpoints", f"step {step}: {path}")

    def on_rollback(self, trainer: TrainerView, rollback: Rollback) -> None:
        self.rewind(rollback.to_step)
        for event in self._step_events:
            self._write_event(event)
        self._step_events.clear()
        self.scalars(rollback.from_step, {"rollback/to_step": float(rollback.to_step)})
        text = (
            f"rolled back from step {rollback.from_step} to the checkpoint at step "
            f"{rollback.to_step}, skipping {rollback.skipped_samples} samples; the learning rate "
            f"anneals over {rollback.anneal_steps} steps"
        )
        self.note(rollback.from_step, "rollbacks", text)

    def post_train(self, trainer: TrainerView, history: RunHistory) -> None:
        ended = history.end + (f": {history.message}" if history.message else "")
        self.note(trainer.position.step, "run", ended)
        self.completed = True

    def close(self, trainer: TrainerView) -> None:
        self.shut()
