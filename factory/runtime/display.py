"""What the user sees while a run trains: a rich bar, plain lines, or progress reports.

:class:`StepDisplay` draws a rich progress bar with the step, loss, learning
rate, gradient norm, tokens/s and ETA, and prints the monitor events and
rollbacks above it as they happen; without a terminal it prints a plain line
every ``log_every`` steps instead. :class:`StepProgress` reports the steps to a
job's ``progress(stage, done, total)`` callback (``factory.progress``). Only rank
0 shows anything.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.progress import Progress as Bar

from factory.progress import Progress
from factory.runtime.callbacks import Callback, Event, Rollback

if TYPE_CHECKING:
    from factory.runtime.step import StepOutcome
    from factory.runtime.trainer import RunHistory, StepRecord, Trainer

__all__ = ["StepDisplay", "StepProgress"]


class StepDisplay(Callback):
    """A rich bar when ``bar``; else a plain line every ``log_every`` steps (0: none)."""

    def __init__(self, bar: bool, log_every: int = 0, description: str = "train") -> None:
        self.enabled, self.log_every, self.description = bar, log_every, description
        self.bar: Any = None
        self.task: Any = None
        self.total = 0

    def pre_train(self, trainer: Trainer) -> None:
        if not trainer.ranks.is_main:
            self.enabled, self.log_every = False, 0
        self.total = trainer.steps
        if not self.enabled:
            return
        self.bar = Bar(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[status]}"),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
        )
        self.bar.__enter__()
        self.task = self.bar.add_task(
            self.description, total=self.total, completed=trainer.position.step, status=""
        )

    def on_event(self, trainer: Trainer, event: Event) -> None:
        self.say(f"[{event.action}] {event.monitor}: {event.message}")

    def on_rollback(self, trainer: Trainer, rollback: Rollback) -> None:
        self.say(
            f"rollback: step {rollback.from_step} -> {rollback.to_step}, "
            f"{rollback.skipped_samples} samples skipped"
        )

    def post_step(self, trainer: Trainer, record: StepRecord, outcome: StepOutcome) -> None:
        step = trainer.position.step
        tokens_per_s = outcome.tokens / max(record.seconds, 1e-9)
        status = (
            f"loss {record.lm_loss:.4f} lr {record.lr:.2e} |g| {record.grad_norm:.3f} "
            f"{tokens_per_s:,.0f} tok/s"
        )
        if self.bar is not None:
            self.bar.update(self.task, completed=step, status=status)
        elif self.log_every and step % self.log_every == 0:
            self.say(f"{self.description} step {step}/{self.total}: {status}")

    def post_train(self, trainer: Trainer, history: RunHistory) -> None:
        if history.end != "completed":
            self.say(
                f"{self.description}: stopped at step {trainer.position.step}: {history.message}"
            )

    def close(self, trainer: Trainer) -> None:
        if self.bar is not None:
            self.bar.__exit__(None, None, None)
            self.bar = None

    def say(self, line: str) -> None:
        """Print above the bar when there is one, else plainly (nohup logs)."""
        if self.bar is not None:
            self.bar.console.print(line)
        elif self.enabled or self.log_every:
            print(line, flush=True)


class StepProgress(Callback):
    """Reports ``progress("train", steps done, steps in the run)`` on rank 0."""

    def __init__(self, progress: Progress) -> None:
        self.progress = progress

    def pre_train(self, trainer: Trainer) -> None:
        if trainer.ranks.is_main:
            self.progress("train", trainer.position.step, trainer.steps)

    def post_step(self, trainer: Trainer, record: StepRecord, outcome: StepOutcome) -> None:
        if trainer.ranks.is_main:
            self.progress("train", trainer.position.step, trainer.steps)
