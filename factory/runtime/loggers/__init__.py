"""Where a run's metrics go: ``training.loggers`` by name, each a trainer callback.

``metrics.jsonl`` (:class:`~factory.runtime.metrics.MetricsLog`) is written by
every run with a run folder, whether ``jsonl`` is listed or not: resuming and
the run report read it. ``tensorboard`` (:mod:`.tensorboard_log`) and ``wandb``
(:mod:`.wandb_log`) get the same step scalars, monitor events, checkpoints and
rollbacks (:mod:`.tracker`), from rank 0 only. Their packages are optional
extras: :func:`require_loggers` says which one is missing before a run starts,
and each tracker's module, which imports its package at the top, is imported
here only when a run asks for it. This module does not import torch.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from factory.runtime.metrics import MetricsLog, metrics_path
from factory.schemas.training import LOGGERS

if TYPE_CHECKING:
    from factory.runtime.callbacks import Callback
    from factory.runtime.ranks import Ranks

__all__ = ["LOGGERS", "PACKAGES", "TRACKERS", "LoggerUnavailable", "require_loggers", "run_loggers"]


class LoggerUnavailable(ImportError):
    """``training.loggers`` names a tracker whose package is not installed."""


def _tensorboard(run_dir: Path) -> Callback:
    from factory.runtime.loggers.tensorboard_log import TensorBoardLog

    return TensorBoardLog(run_dir)


def _wandb(run_dir: Path) -> Callback:
    from factory.runtime.loggers.wandb_log import WandbLog

    return WandbLog(run_dir)


TRACKERS: dict[str, Callable[[Path], Callback]] = {"tensorboard": _tensorboard, "wandb": _wandb}
"""Each logger besides ``jsonl``: its tracker for a run folder (rank 0's)."""
PACKAGES: dict[str, str] = {"tensorboard": "tensorboard", "wandb": "wandb"}
"""The package each tracker imports, also the name of the extra that installs it."""


def require_loggers(names: Iterable[str]) -> None:
    """Raise :class:`LoggerUnavailable` naming each logger whose package is missing."""
    missing = [n for n in names if n in PACKAGES and importlib.util.find_spec(PACKAGES[n]) is None]
    if missing:
        needs = [f"{n} needs the {PACKAGES[n]} package" for n in missing]
        raise LoggerUnavailable(
            f"training.loggers: {'; '.join(needs)}: pip install "
            f"'nemotron-factory[{','.join(missing)}]', or leave "
            f"{'it' if len(missing) == 1 else 'them'} out of training.loggers"
        )


def run_loggers(names: Iterable[str], run_dir: Path, ranks: Ranks) -> list[Callback]:
    """``metrics.jsonl`` (every rank its own file), then rank 0's tracker for each other
    logger in ``names``, in their order."""
    names = list(names)
    unknown = sorted(set(names) - set(LOGGERS))
    if unknown:
        raise ValueError(f"training.loggers: unknown {unknown}; known: {', '.join(LOGGERS)}")
    require_loggers(names)
    loggers: list[Callback] = [MetricsLog(metrics_path(run_dir, ranks))]
    if ranks.is_main:
        loggers.extend(TRACKERS[name](run_dir) for name in names if name in TRACKERS)
    return loggers
