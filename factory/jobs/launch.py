"""Launching a blueprint's layout on several processes: what is refused before any process
group exists, and the ``torchrun`` command that ``factory train --nproc N`` runs.

``torchrun --nproc-per-node N -m factory train BLUEPRINT`` starts N copies of
``factory train``; each finds ``WORLD_SIZE``, ``RANK`` and ``LOCAL_RANK`` in
its environment (``factory.jobs.train``). Refused here, naming the field and the
value that would work: a ``WORLD_SIZE`` other than ``parallelism.world_size``
(the layout is the blueprint's, not the launcher's), and on several processes
whatever factory's runtime does not run yet
(``factory.checks.runtime_rules.runtime_refusals``, which ``factory validate``
reports as the ``runtime.*`` rules).

torchrun ends a launch whose worker exits non-zero with its own traceback and
failure summary, whatever the worker printed; :func:`tell_torchrun` puts a
refusal's one line into that summary (the ``traceback`` field of the root
cause, instead of a link to torchelastic's documentation), through the error
file torchrun gives each worker.

This module does not import torch.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from factory.checks.runtime_rules import runtime_refusals
from factory.precision.backends import PrecisionBackend

if TYPE_CHECKING:
    from factory.schemas.blueprint import Blueprint

__all__ = [
    "LaunchRefused",
    "check_launch",
    "launched_world_size",
    "shutdown_grace_seconds",
    "tell_torchrun",
    "torchrun_args",
]

TORCHRUN_ERROR_FILE = "TORCHELASTIC_ERROR_FILE"
"""Where torchrun's agent reads a failed worker's error (torchelastic's error-file format)."""


class LaunchRefused(ValueError):
    """A layout that cannot be launched with this many processes or by this runtime;
    ``path`` is the blueprint field at fault (the CLI reports its file and line), ``rule``
    the validate rule that reports the same (None where none does)."""

    def __init__(self, message: str, path: str = "parallelism", rule: str | None = None) -> None:
        super().__init__(message)
        self.path = path
        self.rule = rule


def launched_world_size() -> int:
    """Processes in this launch: torchrun's ``WORLD_SIZE``, 1 when not launched by it."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        raise LaunchRefused(f"WORLD_SIZE={os.environ['WORLD_SIZE']!r} is not a number") from None


def check_launch(bp: Blueprint, world_size: int, backend: PrecisionBackend = "auto") -> None:
    """Raise :class:`LaunchRefused` unless factory's runtime can run ``bp``'s layout on
    ``world_size`` processes with the precision ``backend``."""
    par = bp.parallelism
    if world_size != par.world_size:
        raise LaunchRefused(
            f"{world_size} processes were launched but {bp.meta.name}'s layout has "
            f"parallelism.world_size={par.world_size}: launch {par.world_size}, or pass "
            f"--set parallelism.world_size={world_size} (dp is derived from it)",
            path="parallelism.world_size",
        )
    if world_size == 1:
        return
    refused = runtime_refusals(bp, backend)
    if refused:
        rule, finding = refused[0]
        raise LaunchRefused(finding.message, path=finding.path, rule=rule)


def torchrun_args(nproc: int, factory_args: Sequence[str]) -> list[str]:
    """torchrun's arguments for ``factory train --nproc N``: this machine (one node, a free
    rendezvous port), N copies of ``python -m factory`` with ``factory_args``."""
    return ["--standalone", f"--nproc-per-node={nproc}", "-m", "factory", *factory_args]


def shutdown_grace_seconds() -> int:
    """How long torchrun's agent waits, after passing a SIGTERM on to the ranks, before it
    kills them: long enough for the checkpoint they write first (``FACTORY_SHUTDOWN_GRACE_S``,
    default 600; the scheduler's own grace period is the real bound)."""
    return int(os.environ.get("FACTORY_SHUTDOWN_GRACE_S", "600"))


def tell_torchrun(line: str) -> None:
    """Leave ``line`` where torchrun's agent reads why this worker failed (nothing when not
    launched by torchrun, or when the file cannot be written: the line was printed anyway)."""
    path = os.environ.get(TORCHRUN_ERROR_FILE)
    if not path:
        return
    error = {
        "message": line,
        "extraInfo": {"py_callstack": line, "timestamp": str(int(time.time()))},
    }
    try:
        with open(path, "w", encoding="utf-8") as handle:
            json.dump({"message": error}, handle)
    except OSError:
        pass
