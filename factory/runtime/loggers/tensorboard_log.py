"""TensorBoard: event files in ``<run>/tensorboard/``, through ``torch.utils.tensorboard``.

A resumed run appends a new event file to the same folder. Each writer starts
with a purge mark at the step the run starts from, and a rollback writes one at
the step it went back to: TensorBoard's readers then drop the steps the run
went back over, so a curve shows each step once, as the run kept it
(``metrics.jsonl`` keeps both). Scalars are flushed at every checkpoint and
every :data:`FLUSH_SECONDS`, so a killed run loses little.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from tensorboard.compat.proto.event_pb2 import Event, SessionLog
from torch.utils.tensorboard import SummaryWriter

from factory.runtime.loggers.tracker import Tracker

if TYPE_CHECKING:
    from factory.runtime.callbacks import TrainerView

__all__ = ["FLUSH_SECONDS", "TENSORBOARD", "TensorBoardLog"]

TENSORBOARD = "tensorboard"
"""The folder of the run that holds the event files."""
FLUSH_SECONDS = 30


class TensorBoardLog(Tracker):
    """Rank 0's scalars and notes as TensorBoard events."""

    def __init__(self, run_dir: Path) -> None:
        super().__init__(run_dir)
        self._writer: SummaryWriter | None = None

    def open(self, trainer: TrainerView) -> None:
        self._writer = SummaryWriter(
            log_dir=str(self.run_dir / TENSORBOARD),
            purge_step=trainer.position.step,
            flush_secs=FLUSH_SECONDS,
        )

    @property
    def writer(self) -> SummaryWriter:
        assert self._writer is not None, "TensorBoardLog written to before pre_train"
        return self._writer

    def scalars(self, step: int, values: dict[str, float]) -> None:
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, step)

    def note(self, step: int, tag: str, text: str) -> None:
        self.writer.add_text(tag, text, step)

    def rewind(self, step: int) -> None:
        # What SummaryWriter(purge_step=) writes first: readers drop what came before at or
        # after ``step``. A new writer would do the same but start another file per rollback.
        start = Event(step=step, session_log=SessionLog(status=SessionLog.START))
        self.writer.file_writer.add_event(start)

    def on_checkpoint(self, trainer: TrainerView, path: Path, seconds: float) -> None:
        super().on_checkpoint(trainer, path, seconds)
        self.writer.flush()

    def shut(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
