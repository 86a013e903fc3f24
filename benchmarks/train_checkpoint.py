"""Checkpoint timings of ``python -m benchmarks train``: sync, async idle, async under training.

See ``benchmarks/train.py`` for what each measures; the trainer passed in is
its :class:`~benchmarks.train.Trainer`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from factory.runtime.checkpoint import clone_tensors

__all__ = ["Saves", "save_async", "save_async_idle", "save_sync", "steps_under_async_save"]

Trainer = Any  # benchmarks.train.Trainer (which imports this module)


@dataclass
class Saves:
    """Checkpoint timings in seconds, one entry per save."""

    sync: list[float] = field(default_factory=list)
    snapshot: list[float] = field(default_factory=list)
    async_call: list[float] = field(default_factory=list)
    """``save()`` with async_save=True: clone, DCP staging, hand-off (snapshot excluded)."""
    async_write_idle: list[float] = field(default_factory=list)
    async_write_training: list[float] = field(default_factory=list)
    async_finish: list[float] = field(default_factory=list)
    """``wait()``/``poll()`` completing a finished write on the training thread."""
    overlapped_steps: list[float] = field(default_factory=list)
    clone: list[float] = field(default_factory=list)
    """A ``clone()`` of every tensor of the state, timed alone: what one copy costs."""
    size: int = 0


def _folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def save_sync(trainer: Trainer, root: Path, saves: Saves) -> None:
    from factory.runtime.checkpoint import Checkpointer

    ckpt = Checkpointer(root, keep=1, async_save=False)
    start = time.perf_counter()
    state, local, meta = trainer.snapshot()
    snapped = time.perf_counter()
    path = ckpt.save(trainer.position.step, state, local, meta)
    saves.sync.append(time.perf_counter() - start)
    saves.snapshot.append(snapped - start)
    saves.size = _folder_bytes(path)
    start = time.perf_counter()
    clone_tensors(state)
    saves.clone.append(time.perf_counter() - start)


def save_async(trainer: Trainer, ckpt: Any, saves: Saves) -> float:
    """``snapshot`` + ``save()``; returns when save() returned (perf_counter)."""
    start = time.perf_counter()
    state, local, meta = trainer.snapshot()
    snapped = time.perf_counter()
    ckpt.save(trainer.position.step, state, local, meta)
    returned = time.perf_counter()
    saves.snapshot.append(snapped - start)
    saves.async_call.append(returned - snapped)
    return returned


def save_async_idle(trainer: Trainer, ckpt: Any, saves: Saves) -> None:
    returned = save_async(trainer, ckpt, saves)
    ckpt.pending.future.result()
    written = time.perf_counter()
    ckpt.wait()
    saves.async_write_idle.append(written - returned)
    saves.async_finish.append(time.perf_counter() - written)


def steps_under_async_save(
    trainer: Trainer, ckpt: Any, saves: Saves, steps: int
) -> list[dict[str, float]]:
    """Start an async save, then train ``steps`` steps, polling after each as the loop does.
    Returns the steps that started after the write had ended."""
    returned = save_async(trainer, ckpt, saves)
    ended: list[float] = []
    ckpt.pending.future.add_done_callback(lambda _: ended.append(time.perf_counter()))
    clean = []
    for _ in range(steps):
        started = time.perf_counter()
        clock = trainer.step()
        if ended and started >= ended[0]:
            clean.append(clock)
        else:
            saves.overlapped_steps.append(clock["step"])
        if ckpt.pending is not None and ckpt.pending.future.done():
            polled = time.perf_counter()
            ckpt.poll()
            saves.async_finish.append(time.perf_counter() - polled)
    if ckpt.pending is not None:  # the write outlasted the repeat's steps
        ckpt.pending.future.result()
        polled = time.perf_counter()
        ckpt.wait()
        saves.async_finish.append(time.perf_counter() - polled)
    # the future's callbacks run just after result() wakes up: a late stamp is a moment away
    saves.async_write_training.append((ended[0] if ended else time.perf_counter()) - returned)
    return clean
