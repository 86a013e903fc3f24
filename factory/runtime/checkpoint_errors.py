"""What can go wrong with a training checkpoint, torch-free so that the CLI can catch it.

Reading: :class:`CheckpointError` (nothing to resume, another model's
checkpoint, a data position that does not fit) and its kind
:class:`CheckpointDamaged` (files that cannot be read: the trainer falls back
to an older checkpoint). Writing: :class:`CheckpointWriteError`, an
``OSError`` naming the folder that could not be written and why (a full disk
among the causes), raised after the partial write was removed.
"""

from __future__ import annotations

import os

from factory.io import DISK_FULL

__all__ = ["CheckpointDamaged", "CheckpointError", "CheckpointWriteError"]


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed: missing, corrupt, or from another model."""


class CheckpointDamaged(CheckpointError):
    """A checkpoint whose files cannot be read (truncated, corrupt, missing a file)."""


class CheckpointWriteError(OSError):
    """Checkpoint ``step`` could not be written into ``filename`` (its temporary folder, now
    removed); the checkpoints written before it are intact."""

    def __init__(self, code: int, path: str, step: int, cause: str) -> None:
        what = "the disk is full" if code in DISK_FULL else "cannot be written"
        detail = os.strerror(code) if code else cause
        super().__init__(
            code,
            f"{what} ({detail}); the checkpoint of step {step} was not written, the ones "
            "before it are intact: rerun the same command to resume from the newest",
            path,
        )
        self.step = step

    def __str__(self) -> str:
        return f"{self.filename}: {self.strerror}"
