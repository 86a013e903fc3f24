"""Progress of long jobs: the callback type, and its rendering in a terminal or a log.

A job reports ``progress(stage, done, total)`` (:data:`Progress`) and never
prints; :class:`RichProgress` turns those calls into a bar per stage in a
terminal. A stage's bar ends as soon as the stage is complete, so a job can hand
the terminal to another live display between stages (the training loop draws
its own bar): rich allows one live display at a time. Where the output is not a
terminal (CI, Slurm, nohup, ``| tee``) a live display would leave blank lines, so
the same calls become plain timestamped lines: a stage's start, its count every
:data:`PLAIN_EVERY_S` seconds, and its end with the time it took. A
:data:`LogFormat` forces either (``--log-format``); :func:`stamped` and
:func:`duration` are the log's line and duration formats, which the training
loop's step lines share (``factory.runtime.display``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from enum import StrEnum
from types import TracebackType

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, TaskID, TextColumn, TimeElapsedColumn
from rich.progress import Progress as RichBar

__all__ = [
    "PLAIN_EVERY_S",
    "PLAIN_EVERY_STEPS",
    "LogFormat",
    "Progress",
    "RichProgress",
    "duration",
    "plain_log",
    "silent",
    "stamped",
]

PLAIN_EVERY_S = 30.0
"""Seconds between two plain lines of one stage's count (a log's pace, not a bar's)."""
PLAIN_EVERY_STEPS = 10
"""Optimizer steps between two plain step lines of a training, at most (or PLAIN_EVERY_S)."""


class LogFormat(StrEnum):
    """How progress is shown: ``rich`` a live display, ``plain`` timestamped lines, ``auto``
    the first in a terminal and the second elsewhere (CI, Slurm, nohup, a pipe)."""

    auto = "auto"
    plain = "plain"
    rich = "rich"


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

    def __init__(
        self,
        console: Console | None = None,
        clock: Callable[[], float] = time.monotonic,
        log_format: LogFormat = LogFormat.auto,
    ) -> None:
        self.console = console or Console(stderr=True)
        self.plain = plain_log(log_format, self.console)
        self.clock = clock
        self._bar: RichBar | None = None
        self._stage = ""
        self._task: TaskID | None = None
        self._began = self._said = 0.0

    def __call__(self, stage: str, done: int, total: int) -> None:
        if self.plain:
            self._line(stage, done, total)
            return
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

    def _line(self, stage: str, done: int, total: int) -> None:
        """Off a terminal: a stage's start, its count now and then, and its end."""
        now = self.clock()
        if stage != self._stage:
            self._stage, self._began, self._said = stage, now, now
            self._say(f"{stage}: started" + (f" ({total:,} to do)" if total else ""))
        count = f"{done:,}/{total:,}" if total else f"{done:,}"
        if 0 < total <= done:
            self._say(f"{stage}: {count} done in {duration(now - self._began)}")
            self._stage = ""
        elif now - self._said >= PLAIN_EVERY_S:
            self._said = now
            self._say(f"{stage}: {count} after {duration(now - self._began)}")

    def _say(self, line: str) -> None:
        self.console.print(stamped(line), markup=False, highlight=False, soft_wrap=True)

    @property
    def drawing(self) -> bool:
        """Whether a stage is being reported (a bar is live, or a log's stage is open)."""
        return self._bar is not None or (self.plain and bool(self._stage))

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


def plain_log(log_format: LogFormat, console: Console) -> bool:
    """Whether ``log_format`` means plain lines on ``console`` (``auto``: off a terminal)."""
    if log_format == "auto":
        return not console.is_terminal
    return log_format == "plain"


def stamped(line: str) -> str:
    """``2026-01-31 14:05:09 line``: a log line with the local time it was written."""
    return f"{time.strftime('%Y-%m-%d %H:%M:%S')} {line}"


def duration(seconds: float) -> str:
    """``42 s``, ``3 min 20 s``, ``2 h 05 min``: a duration as people read it in a log."""
    whole = round(seconds)
    if whole < 60:
        return f"{whole} s"
    minutes, secs = divmod(whole, 60)
    if minutes < 60:
        return f"{minutes} min {secs:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"
