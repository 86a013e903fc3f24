"""The run's metrics log and what the user sees while it trains.

``metrics.jsonl`` holds one JSON object per line, flushed as it is written, so
a killed run keeps everything up to its last step; ``factory report`` reads it
(``factory.report.run_metrics``). Kinds: ``run`` (first), ``step``, ``event``,
``checkpoint``, ``rollback`` and ``end``.
"""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:
    from factory.runtime.ranks import Ranks

__all__ = ["MetricsLog", "StepDisplay", "metrics_path"]


def _finite(value: Any) -> Any:
    """JSON has no NaN or infinity: they are written as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    return value


def metrics_path(run_dir: Path | None, ranks: Ranks) -> Path | None:
    """Rank 0's ``metrics.jsonl``; every other rank's ``ranks/rank_NNNNN.jsonl``."""
    if run_dir is None:
        return None
    if ranks.is_main:
        return run_dir / "metrics.jsonl"
    return run_dir / "ranks" / f"rank_{ranks.rank:05d}.jsonl"


class MetricsLog:
    """Appends records to ``metrics.jsonl`` (a resumed run continues the same file)."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._file: IO[str] | None = None
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file = path.open("a", encoding="utf-8")

    def write(self, kind: str, **fields: Any) -> None:
        if self._file is None:
            return
        record = {"kind": kind, **{k: _finite(v) for k, v in fields.items()}}
        self._file.write(json.dumps(record, sort_keys=False) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class StepDisplay(contextlib.AbstractContextManager["StepDisplay"]):
    """A rich progress bar with the step, loss, tokens/s and ETA, and the monitor events
    printed above it as they happen; silent (or plain lines every ``log_every`` steps)
    when not enabled."""

    def __init__(self, enabled: bool, total: int, start: int, description: str, log_every: int):
        self.enabled, self.total, self.log_every = enabled, total, log_every
        self.description = description
        self.bar: Any = None
        self.task: Any = None
        self.start = start

    def __enter__(self) -> StepDisplay:
        if not self.enabled:
            return self
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self.bar = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[status]}"),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
        )
        self.bar.__enter__()
        self.task = self.bar.add_task(
            self.description, total=self.total, completed=self.start, status=""
        )
        return self

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.__exit__(*exc)

    def step(self, step: int, loss: float, lr: float, grad_norm: float, tokens_per_s: float):
        status = f"loss {loss:.4f} lr {lr:.2e} |g| {grad_norm:.3f} {tokens_per_s:,.0f} tok/s"
        if self.bar is not None:
            self.bar.update(self.task, completed=step, status=status)
        elif self.log_every and step % self.log_every == 0:
            self.say(f"{self.description} step {step}/{self.total}: {status}")

    def say(self, line: str) -> None:
        """Print above the bar when there is one, else plainly (nohup logs)."""
        if self.bar is not None:
            self.bar.console.print(line)
        elif self.enabled or self.log_every:
            print(line, flush=True)
