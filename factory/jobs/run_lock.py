"""One training per run folder: an advisory lock held for the whole run.

Two trainings writing one folder would race on its checkpoints and interleave
their ``metrics.jsonl``. The process that launches a run holds an exclusive
``flock`` on ``RUN_DIR/.lock`` until it ends: ``factory train --nproc N``
takes it before torchrun starts the ranks and tells them so through
:data:`HELD_BY_LAUNCHER`; under a bare ``torchrun`` rank 0 takes it and tells
the others its answer. The kernel drops the lock with the process, so a run
that was killed (SIGKILL, a lost node) never blocks the rerun. The file holds
the holder's pid, for the message.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

from factory.jobs.train import TrainRefused

__all__ = ["HELD_BY_LAUNCHER", "LOCK_NAME", "RunFolderBusy", "held_run_folder", "try_lock"]

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


def try_lock(folder: Path) -> tuple[int | None, str]:
    """Lock ``folder`` for this process: (the lock's file descriptor, "") or (None, the
    holder's pid as its lock file says)."""
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 64).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        return None, holder
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd, ""


@contextlib.contextmanager
def held_run_folder(folder: Path) -> Iterator[None]:
    """Hold ``folder`` for the block; :class:`RunFolderBusy` when another process does."""
    fd, holder = try_lock(folder)
    if fd is None:
        raise RunFolderBusy(folder, holder)
    try:
        yield
    finally:
        os.close(fd)  # closing the last descriptor drops the lock


def held_by_launcher(folder: Path) -> bool:
    """Whether the process that launched this one holds ``folder`` already."""
    return os.environ.get(HELD_BY_LAUNCHER) == str(folder)
