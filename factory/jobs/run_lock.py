"""One training per run folder: ``factory.folder_lock`` on ``RUN_DIR/.lock`` for the whole run.

Two trainings writing one folder would race on its checkpoints and interleave their
``metrics.jsonl``. The process that launches a run holds the lock until it ends:
``factory train --nproc N`` takes it before torchrun starts the ranks and tells them so
through :data:`HELD_BY_LAUNCHER`; under a bare ``torchrun`` rank 0 takes it and tells the
others its answer.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from factory.folder_lock import FolderBusy, release, try_lock
from factory.jobs.train_errors import TrainRefused

__all__ = ["HELD_BY_LAUNCHER", "LOCK_NAME", "RunFolderBusy", "held_run_folder", "lock_run_folder"]

LOCK_NAME = ".lock"
HELD_BY_LAUNCHER = "FACTORY_RUN_FOLDER_HELD"
"""Environment variable naming the run folder the launching process holds for its ranks."""


class RunFolderBusy(TrainRefused):
    """Another training holds the run folder (the CLI exits 2)."""

    def __init__(self, folder: Path, pid: str) -> None:
        super().__init__(
            f"{folder}: another training is writing this run folder (pid {pid}); wait for it "
            "to end, or train into another folder"
        )
        self.folder, self.pid = folder, pid


def lock_run_folder(folder: Path) -> tuple[int | None, str]:
    """Lock ``folder`` for this process: (the lock's descriptor, "") or (None, the holder's
    pid), so that ranks can agree on the answer before any of them raises."""
    try:
        return try_lock(folder, LOCK_NAME), ""
    except FolderBusy as busy:
        return None, busy.holder


@contextlib.contextmanager
def held_run_folder(folder: Path) -> Iterator[None]:
    """Hold ``folder`` for the block; :class:`RunFolderBusy` when another process does."""
    fd, holder = lock_run_folder(folder)
    if fd is None:
        raise RunFolderBusy(folder, holder)
    try:
        yield
    finally:
        release(fd)


def held_by_launcher(folder: Path) -> bool:
    """Whether the process that launched this one holds ``folder`` already."""
    return os.environ.get(HELD_BY_LAUNCHER) == str(folder)
