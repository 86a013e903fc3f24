"""One data build at a time per output folder.

Two builds into one ``--out`` would sweep each other's temporary files and
publish a mix of both. The lock is ``fcntl.flock`` on ``<out>/.build.lock``:
the kernel drops it when the holding process ends however it ends, so a
build killed with SIGKILL never leaves a lock that blocks the rerun. The
holder writes its pid into the file for the refusal message and empties it
again when it is done, so a finished folder holds the same bytes every time.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from factory.data.build_refusals import BuildRefused

__all__ = ["LOCK_NAME", "build_lock"]

LOCK_NAME = ".build.lock"


def _holder(fd: int) -> str:
    """`` (pid N)`` from the lock file, or nothing while the holder has not written it yet."""
    text = os.pread(fd, 32, 0).decode("ascii", errors="replace").strip()
    return f" (pid {text})" if text.isdigit() else ""


@contextmanager
def build_lock(out: Path) -> Iterator[None]:
    """Hold ``out``'s build lock for the body; ``BuildRefused`` if another build holds it."""
    fd = os.open(out / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            cause = (
                f"another data build{_holder(fd)} is writing this folder; "
                "wait for it to finish or build into another --out"
            )
            raise BuildRefused(out, cause) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        try:
            yield
        finally:
            os.ftruncate(fd, 0)
    finally:
        os.close(fd)  # closing the last descriptor releases the lock
