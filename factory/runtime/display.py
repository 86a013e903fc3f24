"""What the user sees while a run trains: a rich bar, plain log lines, or progress reports.

:class:`StepDisplay` draws a rich progress bar with the step, loss, learning
rate, gradient norm, tokens/s and ETA, and prints the monitor events and
rollbacks above it as they happen. Without a terminal (CI, Slurm, nohup, a pipe)
it writes the same as plain timestamped lines instead (``factory.progress``'s
format): first the run's kernel report (``factory.runtime.run_kernels``: which kernel
each layer type runs, whether its blocks are compiled, every fallback with its reason),
then a step line for the run's first and last steps and every ``log_every``
steps or ``log_every_s`` seconds, whichever comes first, and a line for each
event and rollback. :class:`StepProgress` reports the steps to a job's
``progress(stage, done, total)`` callback (``factory.progress``). Only rank 0
shows anything; everything goes to stderr, where the jobs' progress goes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.progress import Progress as Bar

from factory.progress import Progress, duration, stamped
from factory.runtime.callbacks import Callback, Event, Rollback, TrainerView
from factory.runtime.run_kernels import run_kernel_lines

if TYPE_CHECKING:
    from factory.runtime.history import RunHistory, StepRecord
    from factory.runtime.step import StepOutcome

__all__ = ["StepDisplay", "StepProgress"]


def _kernel_report(trainer: TrainerView) -> list[str]:
    return run_kernel_lines(trainer.compiled, trainer.ranks.device.type)


class StepDisplay(Callback):
    """A rich bar when ``bar``; else a timestamped line every ``log_every`` steps or
    ``log_every_s`` seconds (both 0: nothing), and at the run's first and last steps.
    Either way the run begins with ``first_lines`` (default: its kernel report), read once
    the model is built and laid out."""

    def __init__(
        self,
        bar: bool,
        log_every: int = 0,
        description: str = "train",
        log_every_s: float = 0.0,
        console: Console | None = None,
        clock: Callable[[], float] = time.monotonic,
        first_lines: Callable[[TrainerView], list[str]] | None = None,
    ) -> None:
        self.enabled, self.description = bar, description
        self.first_lines = first_lines or _kernel_report
        self.log_every, self.log_every_s = log_every, log_every_s
        self.console = console
        self.clock = clock
        self.bar: Any = None
        self.task: Any = None
        self.total = 0
        self._began = self._said = 0.0
        self._first = 0

    @property
    def writes_lines(self) -> bool:
        """Whether plain lines are written (no bar, and a cadence asked for)."""
        return self.bar is None and bool(self.log_every or self.log_every_s)

    def pre_train(self, trainer: TrainerView) -> None:
        if not trainer.ranks.is_main:
            self.enabled, self.log_every, self.log_every_s = False, 0, 0.0
        self.total, self._first = trainer.steps, trainer.position.step
        self._began = self._said = self.clock()
        if self.console is None:  # a forced bar draws even where stderr is not a terminal
            self.console = Console(stderr=True, force_terminal=True if self.enabled else None)
        if self.enabled:
            self._start_bar(trainer)
        if self.bar is not None or self.writes_lines:
            for line in self.first_lines(trainer):
                self.say(f"{self.description}: {line}")

    def _start_bar(self, trainer: TrainerView) -> None:
        self.bar = Bar(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[status]}"),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=self.console,
        )
        self.bar.__enter__()
        self.task = self.bar.add_task(
            self.description, total=self.total, completed=trainer.position.step, status=""
        )

    def on_event(self, trainer: TrainerView, event: Event) -> None:
        self.say(f"{self.description}: [{event.action}] {event.monitor}: {event.message}")

    def on_rollback(self, trainer: TrainerView, rollback: Rollback) -> None:
        self.say(
            f"{self.description}: rollback from step {rollback.from_step} to "
            f"{rollback.to_step}, {rollback.skipped_samples} samples skipped"
        )

    def post_step(self, trainer: TrainerView, record: StepRecord, outcome: StepOutcome) -> None:
        step = trainer.position.step
        tokens_per_s = f"{outcome.tokens / max(record.seconds, 1e-9):,.0f} tok/s"
        loss, lr = f"loss {record.lm_loss:.4f}", f"lr {record.lr:.2e}"
        if self.bar is not None:
            status = f"{loss} {lr} |g| {record.grad_norm:.3f} {tokens_per_s}"
            self.bar.update(self.task, completed=step, status=status)
        elif self.writes_lines and self._due(step):
            self._said = self.clock()
            self.say(
                f"{self.description}: step {step}/{self.total}, {loss}, {lr}, "
                f"grad norm {record.grad_norm:.3f}, {tokens_per_s}, {self._eta(step)}"
            )

    def _due(self, step: int) -> bool:
        """The run's first and last steps, every ``log_every`` steps, or ``log_every_s``
        seconds after the last line."""
        if step in (self._first + 1, self.total):
            return True
        if self.log_every and step % self.log_every == 0:
            return True
        return bool(self.log_every_s) and self.clock() - self._said >= self.log_every_s

    def _eta(self, step: int) -> str:
        """The time left at this run's pace so far (rollbacks included)."""
        done = step - self._first
        if done <= 0 or step >= self.total:
            return "ETA 0 s"
        return f"ETA {duration((self.clock() - self._began) / done * (self.total - step))}"

    def post_train(self, trainer: TrainerView, history: RunHistory) -> None:
        if history.end != "completed":
            self.say(
                f"{self.description}: stopped at step {trainer.position.step}: {history.message}"
            )

    def close(self, trainer: TrainerView) -> None:
        if self.bar is not None:
            self.bar.__exit__(None, None, None)
            self.bar = None

    def say(self, line: str) -> None:
        """Print above the bar when there is one, else as a timestamped log line."""
        if self.bar is not None:
            self.bar.console.print(line, markup=False, highlight=False)
        elif self.writes_lines and self.console is not None:
            self.console.print(stamped(line), markup=False, highlight=False, soft_wrap=True)


class StepProgress(Callback):
    """Reports ``progress("train", steps done, steps in the run)`` on rank 0."""

    def __init__(self, progress: Progress) -> None:
        self.progress = progress

    def pre_train(self, trainer: TrainerView) -> None:
        if trainer.ranks.is_main:
            self.progress("train", trainer.position.step, trainer.steps)

    def post_step(self, trainer: TrainerView, record: StepRecord, outcome: StepOutcome) -> None:
        if trainer.ranks.is_main:
            self.progress("train", trainer.position.step, trainer.steps)
