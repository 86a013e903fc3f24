"""One data build at a time per output folder (``factory.folder_lock`` on ``<out>/.build.lock``).

Two builds into one ``--out`` would sweep each other's temporary files and publish a mix of
both; the second is refused rather than made to wait, since after waiting it would wipe
the first build's output if its recipe differs.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from factory.data.build_refusals import BuildRefused
from factory.folder_lock import FolderBusy, release, try_lock

__all__ = ["LOCK_NAME", "build_lock"]

LOCK_NAME = ".build.lock"


@contextmanager
def build_lock(out: Path) -> Iterator[None]:
    """Hold ``out``'s build lock for the body; ``BuildRefused`` if another build holds it."""
    try:
        fd = try_lock(out, LOCK_NAME)
    except FolderBusy as busy:
        cause = (
            f"another data build (pid {busy.holder}) is writing this folder; "
            "wait for it to finish or build into another --out"
        )
        raise BuildRefused(out, cause) from None
    try:
        yield
    finally:
        release(fd)
