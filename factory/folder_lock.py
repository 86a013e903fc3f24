"""One writer per output folder: an advisory ``flock`` on a file inside it.

Two processes writing one folder (two data builds into one ``--out``, two trainings into
one run folder) would sweep each other's temporary files or interleave their logs. The
writer holds an exclusive ``flock`` on a lock file in the folder until it is done; the
kernel drops the lock when the process ends however it ends, so a writer killed with
SIGKILL (or on a lost node) never leaves a lock that blocks the rerun. The holder writes
its pid into the file, for the refusal message, and empties it again on release, so a
finished folder holds the same bytes every time.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

from factory.io import naming

__all__ = ["FolderBusy", "held_folder", "release", "try_lock"]

_NO_LOCKS = {errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP}


class FolderBusy(Exception):
    """Another process holds ``folder``'s lock; ``holder`` is its pid, as its lock file says."""

    def __init__(self, folder: Path, holder: str) -> None:
        super().__init__(f"{folder}: held by pid {holder}")
        self.folder, self.holder = folder, holder


def _holder(fd: int) -> str:
    """The pid in the lock file, or "unknown" while its holder has not written it yet."""
    text = os.pread(fd, 32, 0).decode("ascii", errors="replace").strip()
    return text if text.isdigit() else "unknown"


def try_lock(folder: Path, name: str) -> int:
    """Lock ``folder`` (creating it) through its file ``name`` for this process and return
    the lock's descriptor, to :func:`release`; :class:`FolderBusy` if another holds it."""
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder / name, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder(fd)
        os.close(fd)
        raise FolderBusy(folder, holder) from None
    except OSError as exc:  # a filesystem without flock (Lustre mounted without -o flock)
        os.close(fd)
        if exc.errno not in _NO_LOCKS:
            raise
        cause = "this filesystem does not lock files (on Lustre, mount it with -o flock)"
        raise OSError(exc.errno, cause, str(folder / name)) from None
    try:
        with naming(folder / name):  # a full disk: name the file, and let the lock go
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except BaseException:
        os.close(fd)
        raise
    return fd


def release(fd: int) -> None:
    """Empty the lock file and close it: closing the last descriptor drops the lock."""
    try:
        os.ftruncate(fd, 0)
    finally:
        os.close(fd)


@contextlib.contextmanager
def held_folder(folder: Path, name: str) -> Iterator[None]:
    """Hold ``folder``'s lock for the block (see :func:`try_lock`)."""
    fd = try_lock(folder, name)
    try:
        yield
    finally:
        release(fd)
