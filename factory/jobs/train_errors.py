"""What ``factory.train`` refuses, and how a run that started can fail.

A :class:`TrainRefused` is the request's fault or the machine's, said before any
step and with nothing written (the CLI exits 2); :class:`RankLost` is a run cut
short by another rank (exit 1). Torch-free, so the CLI and the run-folder lock
(``factory.jobs.run_lock``) name them without importing the runtime.
"""

from __future__ import annotations

__all__ = [
    "BYTES_PER_PARAM",
    "BackendUnavailable",
    "BadData",
    "CannotLaunch",
    "CannotResume",
    "ModelTooBig",
    "RankLost",
    "TrainRefused",
]

BYTES_PER_PARAM = 16
"""fp32 weight + gradient + two Adam moments: what one process holds per parameter."""


class TrainRefused(Exception):
    """A training request this machine cannot run; nothing was written (the CLI exits 2)."""


class ModelTooBig(TrainRefused):
    """The model's training state needs more memory than this machine has."""

    def __init__(self, name: str, params: int, have_bytes: int, proxy: bool) -> None:
        self.params, self.need_bytes, self.have_bytes = params, params * BYTES_PER_PARAM, have_bytes
        hint = "" if proxy else "; train its CPU proxy (proxy=True, or --proxy)"
        super().__init__(
            f"{name} has {params:,} parameters, whose fp32 weights, gradients and Adam states "
            f"need {self.need_bytes / 2**30:,.0f} GiB, more than this machine's "
            f"{have_bytes / 2**30:,.0f} GiB{hint}"
        )


class BackendUnavailable(TrainRefused, ImportError):
    """The requested precision backend is not installed (Transformer Engine, for ``te``), or
    the package of a tracker ``training.loggers`` names (tensorboard, wandb)."""


class CannotResume(TrainRefused):
    """Nothing to resume, a checkpoint of another model, or one that cannot be read."""


class CannotLaunch(TrainRefused):
    """The launch does not fit the blueprint's layout, or runs what factory's runtime does not
    (``factory.jobs.launch``); refused before any process group is made. ``path`` is the
    blueprint field at fault, ``rule`` the validate rule that says the same (or None)."""

    def __init__(self, message: str, path: str, rule: str | None = None) -> None:
        super().__init__(message)
        self.path = path
        self.rule = rule


class RankLost(RuntimeError):
    """A collective failed mid-run: another rank died or stopped answering (the CLI exits 1)."""


class BadData(TrainRefused):
    """The data folder does not match its manifest (missing, truncated or changed shards)."""
