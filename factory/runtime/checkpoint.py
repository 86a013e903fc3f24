"""Training checkpoints: torch.distributed.checkpoint (DCP), written atomically, resumed exactly.

Layout of ``RUN_DIR/checkpoints/step_00000100/`` (the step is the next one to run):

* DCP files (``.metadata``, ``*.distcp``): the model, the fp32 masters and the
  optimizer state, keyed by parameter name, so a different number of ranks can
  read them back;
* ``rank0.pt`` (and ``rankN.pt`` for every other rank of a distributed run):
  what is private to a process: RNG states and the precision runtime's state
  (stochastic-rounding generators, FP8 amax histories, the BF16 switch), as
  tensors, numbers, strings, lists and dicts only. A run resumed on more ranks
  than wrote the checkpoint gives the new ranks rank 0's;
* ``meta.json``, written last: the step, the data position, the monitors, the
  learning-rate annealing, and the fingerprint of the model it belongs to.

A checkpoint is written into ``.step_00000100.tmp`` and renamed into place
once complete, so a process killed mid-write leaves only a temporary folder,
which is never read and is removed by the next run. A write that fails (a full
disk) removes its temporary folder and raises :class:`CheckpointWriteError`
naming it and the cause; the checkpoints before it stay as they were. A
checkpoint that cannot be read raises :class:`CheckpointDamaged` with a one-line
reason (the trainer then resumes from an older one); one whose pickles would run
code is such a checkpoint (``checkpoint_trust``). With ``async_save`` the
DCP write runs in a background thread on a copy of the state while training
goes on; the rename happens when it has finished.

With several processes (``factory.distributed``) every rank calls ``save``,
``wait`` and ``load`` at the same points: rank 0 makes the folder, all ranks
write their DCP shards (a DCP collective) and their own ``rankN.pt``, and rank
0 alone writes ``meta.json``, renames and prunes. DCP stores every tensor under
its global name and shape, so a checkpoint written by 4 ranks loads on 2 or 1.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import re
import shutil
import time
import warnings
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from factory.runtime.checkpoint_errors import (
    CheckpointDamaged,
    CheckpointError,
    CheckpointWriteError,
)
from factory.runtime.checkpoint_trust import (
    MetadataReader,
    TensorsOnlyPlanner,
    check_local,
    load_local,
)
from factory.runtime.ranks import Ranks, SingleProcess

__all__ = [
    "CheckpointDamaged",
    "CheckpointError",
    "CheckpointWriteError",
    "Checkpointer",
    "clone_tensors",
    "complete_checkpoints",
    "describe_failure",
    "read_checkpoint",
    "read_meta",
    "set_aside",
    "single_process_quiet",
]

_NAME = re.compile(r"^step_(\d{8,})$")
NEARLY_FULL_BYTES = 1 << 20
"""Free space below which a write that failed without saying why failed for want of space
(torch's zip writer reports ENOSPC as a bare ``RuntimeError``)."""


def complete_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """(step, path) of every complete checkpoint under ``root``, oldest first."""
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        match = _NAME.match(path.name)
        if match and (path / "meta.json").is_file():
            found.append((int(match.group(1)), path))
    return sorted(found)


def clone_tensors(state: Any) -> Any:
    """A copy of every tensor, so training may change the originals during an async write."""
    if isinstance(state, torch.Tensor):
        return state.detach().clone()
    if isinstance(state, dict):
        return {k: clone_tensors(v) for k, v in state.items()}
    return state


@dataclass
class _Pending:
    future: Future[Any]
    tmp: Path
    final: Path
    meta: dict[str, Any]
    started: float
    step: int


@dataclass
class Checkpointer:
    """Writes, lists, prunes and reads the checkpoints of one run."""

    root: Path
    keep: int = 3
    """Complete checkpoints kept; older ones are deleted once a newer one is complete."""
    async_save: bool = False
    ranks: Ranks = field(default_factory=SingleProcess)
    pending: _Pending | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        if self.keep < 1:
            raise ValueError(f"keep must be >= 1, got {self.keep}")
        if self.ranks.is_main:
            self.root.mkdir(parents=True, exist_ok=True)
            for stale in self.root.glob(".step_*.tmp"):  # a write that never completed
                shutil.rmtree(stale, ignore_errors=True)
        self.ranks.barrier()

    def save(
        self, step: int, state: dict[str, Any], local: dict[str, Any], meta: dict[str, Any]
    ) -> Path:
        """Write checkpoint ``step``: ``state`` through DCP, ``local`` with torch.save,
        ``meta`` as JSON. Returns its final path (complete at once unless async)."""
        self.wait()
        final = self.root / f"step_{step:08d}"
        tmp = self.root / f".{final.name}.tmp"
        with self._writing(tmp, step):
            if self.ranks.is_main:
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir()
        self.ranks.barrier()
        started = time.perf_counter()
        with self._writing(tmp, step):
            _write_local(local, tmp / _local_file(self.ranks.rank))
            if self.async_save:
                with single_process_quiet():
                    # DCP stages (copies) the tensors before returning: training may go on. Its
                    # planning is a collective, so every rank's own file above is written by
                    # then.
                    future = dcp.async_save(state, checkpoint_id=str(tmp), no_dist=_no_dist())
                self.pending = _Pending(future, tmp, final, meta, started, step)
            else:
                with single_process_quiet():
                    dcp.save(state, checkpoint_id=str(tmp), no_dist=_no_dist())
                self._finish(_Pending(_done(), tmp, final, meta, started, step))
        if not self.async_save:
            self.ranks.barrier()
        return final

    @contextlib.contextmanager
    def _writing(self, tmp: Path, step: int) -> Iterator[None]:
        """Turn a failed write of checkpoint ``step`` into :class:`CheckpointWriteError` once
        its temporary folder is gone (a full disk is said to be one, whatever reported it)."""
        try:
            yield
        except (Exception, CheckpointException) as exc:  # DCP's is a BaseException
            code = _failure_errno(exc, tmp)
            if self.ranks.is_main:
                shutil.rmtree(tmp, ignore_errors=True)
            if code is None:
                raise
            raise CheckpointWriteError(code, str(tmp), step, describe_failure(exc)) from exc

    def poll(self) -> Path | None:
        """Complete a finished async write (never blocks); its path, or None."""
        if self.pending is not None and self.pending.future.done():
            return self.wait()
        return None

    def wait(self) -> Path | None:
        """Block until the async write in flight (if any) is complete and renamed. Every rank
        calls it at the same points: it ends with all ranks agreeing the write is done."""
        pending, self.pending = self.pending, None
        if pending is None:
            return None
        with self._writing(pending.tmp, pending.step):
            pending.future.result()
            final = self._finish(pending)
        self.ranks.barrier()
        return final

    def _finish(self, pending: _Pending) -> Path:
        """Publish a complete write; rank 0's job (DCP's future on rank 0 completes only after
        every rank's shards and the global metadata are written)."""
        if not self.ranks.is_main:
            return pending.final
        meta = {**pending.meta, "seconds": time.perf_counter() - pending.started}
        (pending.tmp / "meta.json").write_text(json.dumps(meta, indent=1) + "\n", encoding="utf-8")
        _fsync_tree(pending.tmp)
        shutil.rmtree(pending.final, ignore_errors=True)
        os.replace(pending.tmp, pending.final)
        self._prune()
        return pending.final

    def _prune(self) -> None:
        for _, path in complete_checkpoints(self.root)[: -self.keep]:
            shutil.rmtree(path, ignore_errors=True)

    def latest(self, before_step: int | None = None) -> Path | None:
        """The newest complete checkpoint (whose step is below ``before_step`` if given), as
        rank 0 sees it (every rank must resume the same one)."""
        found = [
            path for step, path in complete_checkpoints(self.root)
            if before_step is None or step < before_step
        ]  # fmt: skip
        return self.ranks.agree(found[-1] if found else None)


def read_meta(path: Path) -> dict[str, Any]:
    try:
        return json.loads((path / "meta.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CheckpointDamaged(f"{path}: unreadable meta.json ({describe_failure(exc)})") from exc


def _local_file(rank: int) -> str:
    return f"rank{rank}.pt"


def read_checkpoint(
    path: Path, state: dict[str, Any], fingerprint: str, rank: int = 0
) -> tuple[dict[str, Any], dict]:
    """Fill ``state`` (tensors of the right shapes, DTensors for sharded ones) from checkpoint
    ``path`` in place; return (meta, this rank's local state). Raises :class:`CheckpointError` naming the checkpoint and the problem."""
    meta = read_meta(path)
    if meta.get("fingerprint") != fingerprint:
        raise CheckpointError(
            f"{path}: written for another model ({meta.get('blueprint', '?')}, fingerprint "
            f"{str(meta.get('fingerprint'))[:12]}); this run's model has fingerprint "
            f"{fingerprint[:12]}"
        )
    try:
        reader = MetadataReader(path)
        # Read here first: a refusal inside DCP's load is logged with its traceback.
        reader.read_metadata()
        with single_process_quiet():
            dcp.load(
                state,
                checkpoint_id=str(path),
                storage_reader=reader,
                planner=TensorsOnlyPlanner(),
                no_dist=_no_dist(),
            )
        own = path / _local_file(rank)
        local = load_local(own if own.is_file() else path / _local_file(0))
    # DCP reports a damaged file as CheckpointException, a BaseException, besides the usual kinds.
    except (Exception, CheckpointException) as exc:
        _raise_if_the_machine(exc, path)
        raise CheckpointDamaged(f"{path}: cannot be read ({describe_failure(exc)})") from exc
    return meta, local


def _raise_if_the_machine(exc: BaseException, path: Path) -> None:
    """A read that failed for the machine's reasons (memory, an I/O error, a permission, a
    stale NFS handle) says nothing about the checkpoint: raise it as itself rather than fall
    back to an older checkpoint. A missing file is the checkpoint's (damage)."""
    inner = _innermost(exc)
    if isinstance(inner, torch.OutOfMemoryError | MemoryError):
        raise inner from exc
    if isinstance(inner, OSError) and inner.errno not in (None, errno.ENOENT):
        where = inner.filename or str(path)
        raise OSError(inner.errno, inner.strerror or str(inner), where) from exc


def set_aside(path: Path) -> Path:
    """Rename a checkpoint that cannot be read to ``step_N.damaged`` (kept for a look, out of
    the way of resumes and of pruning, which count ``step_N`` folders only)."""
    aside = path.with_name(path.name + ".damaged")
    shutil.rmtree(aside, ignore_errors=True)
    os.replace(path, aside)
    return aside


def describe_failure(exc: BaseException) -> str:
    """One line for a failure: its innermost cause's type and first line (DCP's
    CheckpointException carries every rank's exception and traceback in its text)."""
    inner = _innermost(exc)
    lines = str(inner).strip().splitlines()
    return f"{type(inner).__name__}: {lines[0][:300]}" if lines else type(inner).__name__


def _innermost(exc: BaseException) -> BaseException:
    for _ in range(16):  # a chain is short; a cycle must not hang us
        if isinstance(exc, CheckpointException) and exc.failures:
            exc = next(iter(exc.failures.values()))[0]
        elif exc.__cause__ is not None:
            exc = exc.__cause__
        else:
            break
    return exc


def _failure_errno(exc: BaseException, folder: Path) -> int | None:
    """The errno of a failed write: the OSError's, or ENOSPC where the library hid it but the
    file system has (almost) no space left; None for a failure that is not the storage's."""
    inner = _innermost(exc)
    if isinstance(inner, OSError) and inner.errno:
        return inner.errno
    try:
        free = shutil.disk_usage(folder if folder.exists() else folder.parent).free
    except OSError:
        return None
    return errno.ENOSPC if free < NEARLY_FULL_BYTES else None


def _write_local(local: dict[str, Any], path: Path) -> None:
    """This rank's own state, serialised in memory and written by us, so that a full disk is
    reported as the OSError it is (torch's file writer hides the errno)."""
    buffer = io.BytesIO()
    torch.save(local, buffer)
    check_local(buffer)
    with open(path, "wb") as handle:
        handle.write(buffer.getbuffer())


def _no_dist() -> bool:
    """One process without a process group reads and writes alone (DCP otherwise warns)."""
    return not (torch.distributed.is_available() and torch.distributed.is_initialized())


@contextlib.contextmanager
def single_process_quiet() -> Iterator[None]:
    """DCP warns that it assumes one process even when told so; that is the intent here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _done() -> Future[Any]:
    future: Future[Any] = Future()
    future.set_result(None)
    return future


def _fsync_tree(directory: Path) -> None:
    """Flush every file of ``directory`` and the folder itself before the rename publishes it."""
    for path in directory.iterdir():
        with open(path, "rb") as handle:
            os.fsync(handle.fileno())
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
