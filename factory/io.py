"""Atomic writes: a reader sees the old file or the new one, never half of one.

A write that fails names its file: ``write()`` and ``fsync()`` on a full disk
raise ``OSError(ENOSPC)`` with no file name, and :func:`naming` gives it one,
so the CLI can say which file could not be written.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = [
    "DISK_FULL",
    "atomic_write_bytes",
    "atomic_write_text",
    "folder_bytes",
    "naming",
    "staged_directory",
]

DISK_FULL = frozenset({errno.ENOSPC, errno.EDQUOT})
"""The errnos of a write that found no room: a full disk, or a quota used up."""


@contextmanager
def naming(path: Path) -> Iterator[None]:
    """Re-raise an ``OSError`` that names no file (a write, an fsync) as one naming ``path``."""
    try:
        yield
    except OSError as exc:
        # A broken connection (a Ray worker, a pipe) is not about the file being written.
        if exc.filename is not None or exc.errno is None or isinstance(exc, ConnectionError):
            raise
        raise OSError(exc.errno, exc.strerror or os.strerror(exc.errno), str(path)) from exc


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _publishable(path: Path, mode: int) -> None:
    """mkstemp/mkdtemp create private (0600/0700) entries; give them normal permissions."""
    os.chmod(path, mode & ~_umask())


def _readable_as_the_umask_allows(folder: Path) -> None:
    """Give every file under ``folder`` the permissions a plain ``open`` would have: some
    writers (safetensors' ``save_file``) create theirs 0600, which nobody else on a shared
    cluster can read. Bits a file already has (a script's execute bit) are kept."""
    allowed = 0o666 & ~_umask()
    for path in folder.rglob("*"):
        if path.is_file() and not path.is_symlink():
            mode = path.stat().st_mode & 0o7777
            if mode | allowed != mode:
                os.chmod(path, mode | allowed)


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically, as :func:`atomic_write_bytes` does."""
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to a temporary file beside ``path``, fsync it, then rename it into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with naming(path), os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        _publishable(Path(tmp), 0o666)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@contextmanager
def staged_directory(target: Path) -> Iterator[Path]:
    """Build a directory in a sibling temporary folder and swap it in only on success.

    An existing ``target`` is replaced; if the body raises, ``target`` is untouched
    and the staging folder is removed.
    """
    target = target.resolve()
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    _publishable(staging, 0o777)
    _readable_as_the_umask_allows(staging)
    retired = None
    if target.exists():
        retired = target.with_name(f".{target.name}.old-{os.getpid()}")
        os.replace(target, retired)
    os.replace(staging, target)
    if retired is not None:
        shutil.rmtree(retired, ignore_errors=True)


def folder_bytes(folder: Path) -> int:
    """The bytes of every file under ``folder`` (what it takes on disk, give or take blocks)."""
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file() and not p.is_symlink())
