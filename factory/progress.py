"""Progress of long jobs: the callback type, and a rich rendering of it for terminals.

A job reports ``progress(stage, done, total)`` (:data:`Progress`) and never
prints; :class:`RichProgress` turns those calls into a bar per
stage. A stage's bar ends as soon as the stage is complete, so a job can hand
the terminal to another live display between stages (the training loop draws
its own bar): rich allows one live display at a time.
"""

from __future__ import annotations

from collections.abc import Callable
from types import TracebackType

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, TaskID, TextColumn, TimeElapsedColumn
from rich.progress import Progress as RichBar

__all__ = ["Progress", "RichProgress", "silent"]

Progress = Callable[[str, int, int], None]
"""``progress(stage, done, total)``: ``done`` of ``total`` units of ``stage`` are finished
(``total`` 0: not known yet; a final ``done == total`` report ends a stage).

Stages so far: ``curate`` (input files), ``dedup``, ``plan``, ``shards`` (shards written),
``megatron``, ``energon``, ``report``, ``compile``, ``train`` (optimizer steps), ``export``.
"""


def silent(stage: str, done: int, total: int) -> None:
    """A progress callback that ignores every report."""


class RichProgress:
    """A :data:`Progress` callback drawing the current stage as a transient rich bar.

    Use it as a context manager so that an interrupted job leaves the
    terminal clean::

        with RichProgress(console) as progress:
            factory.data.build("nano", out, progress=progress)
    """

    def __init__(self, console: Console | None = None) -> None:
        self.console = console
        self._bar: RichBar | None = None
        self._stage = ""
        self._task: TaskID | None = None

    def __call__(self, stage: str, done: int, total: int) -> None:
        if self._bar is None or stage != self._stage:
            self.close()
            self._bar, self._task = self._start(stage, total)
            self._stage = stage
        assert self._task is not None
        self._bar.update(self._task, completed=done, total=total or None)
        if 0 < total <= done:
            self.close()

    def _start(self, stage: str, total: int) -> tuple[RichBar, TaskID]:
        bar = RichBar(
            TextColumn("{task.description:>8}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=self.console,
            transient=True,
        )
        bar.start()
        return bar, bar.add_task(stage, total=total or None)

    @property
    def drawing(self) -> bool:
        """Whether a stage's bar is live (an incomplete stage is being reported)."""
        return self._bar is not None

    def close(self) -> None:
        """End the current stage's bar, if one is drawn."""
        if self._bar is not None:
            self._bar.stop()
        self._bar, self._task, self._stage = None, None, ""

    def __enter__(self) -> RichProgress:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.close()
