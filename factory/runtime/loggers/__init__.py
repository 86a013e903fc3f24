"""Where a run's metrics go: ``training.loggers`` by name, each a trainer callback.

``metrics.jsonl`` (:class:`~factory.runtime.metrics.MetricsLog`) is written by
every run with a run folder, whether ``jsonl`` is listed or not: resuming and
the run report read it. Every other name is an experiment tracker, one module
here (TensorBoard's :mod:`.tensorboard_log`, W&B's :mod:`.wandb_log`) with its
entry in :data:`factory.schemas.trackers.TRACKERS`; each gets the same step
scalars, monitor events, checkpoints and rollbacks (:mod:`.tracker`), from rank
0 only. Their packages are optional extras: :func:`require_loggers` says which
one is missing before a run starts, and a tracker's module, which may import its
package at the top, is imported only when a run asks for it. This module does
not import torch.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from factory.runtime.metrics import MetricsLog, metrics_path
from factory.schemas.trackers import TRACKERS, TrackerEntry, logger_names

if TYPE_CHECKING:
    from factory.runtime.callbacks import Callback
    from factory.runtime.loggers.tracker import Tracker
    from factory.runtime.ranks import Ranks

__all__ = ["LoggerUnavailable", "require_loggers", "run_loggers", "tracker_class"]


class LoggerUnavailable(ImportError):
    """``training.loggers`` names a tracker whose package is not installed."""


def tracker_class(entry: TrackerEntry) -> type[Tracker]:
    """The class ``entry.build`` names, its module imported (and its package with it)."""
    module, _, name = entry.build.partition(":")
    return getattr(importlib.import_module(module), name)


def require_loggers(names: Iterable[str]) -> None:
    """Raise :class:`LoggerUnavailable` naming each tracker whose package is missing."""
    asked = [TRACKERS[name] for name in names if name in TRACKERS]
    missing = [e for e in asked if e.package and importlib.util.find_spec(e.package) is None]
    if missing:
        needs = [f"{e.name} needs the {e.package} package" for e in missing]
        extras = ",".join(dict.fromkeys(e.extra for e in missing if e.extra))
        raise LoggerUnavailable(
            f"training.loggers: {'; '.join(needs)}: pip install 'nemotron-factory[{extras}]', "
            f"or leave {'it' if len(missing) == 1 else 'them'} out of training.loggers"
        )


def run_loggers(names: Iterable[str], run_dir: Path, ranks: Ranks) -> list[Callback]:
    """``metrics.jsonl`` (every rank its own file), then rank 0's tracker for each other
    logger in ``names``, in their order."""
    names = list(names)
    unknown = sorted(set(names) - set(logger_names()))
    if unknown:
        raise ValueError(f"training.loggers: unknown {unknown}; known: {', '.join(logger_names())}")
    require_loggers(names)
    loggers: list[Callback] = [MetricsLog(metrics_path(run_dir, ranks))]
    if ranks.is_main:
        loggers.extend(tracker_class(TRACKERS[n])(run_dir) for n in names if n in TRACKERS)
    return loggers
