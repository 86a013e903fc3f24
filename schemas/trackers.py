"""The experiment trackers ``training.loggers`` can name: one entry each, torch-free.

A tracker is one module under ``factory/runtime/loggers/`` (a subclass of
:class:`~factory.runtime.loggers.tracker.Tracker`) and its :class:`TrackerEntry`
here: its name, the optional package its module imports, the ``pyproject.toml``
extra that installs that package, and the class that builds it, as
``"module:Class"``. The training schema takes its allowed names from
:data:`TRACKERS` when it validates, ``tests/test_imports.py`` its deferred
packages, and the runtime what to build (importing the module only for a run that
names it) and which extra to ask for when the package is missing.

Why the entry sits here and not in the tracker's module: ``factory validate``
checks the names, and it must import neither the runtime (which sits above the
schemas in the package stack) nor a tracker's package (TensorBoard's writer
loads torch). So the entry names its module by import path, as a console-script
entry point does, and ``tests/test_runtime_loggers.py`` checks that every entry
builds a tracker and every tracker module has an entry.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["JSONL", "TRACKERS", "TrackerEntry", "logger_names", "register_tracker"]

JSONL = "jsonl"
"""``metrics.jsonl``: the logger every run with a run folder writes, listed or not."""


@dataclass(frozen=True)
class TrackerEntry:
    """One experiment tracker: what ``training.loggers`` calls it and how a run gets it."""

    name: str
    """Its name in ``training.loggers``."""
    build: str
    """``"module:Class"``: the :class:`~factory.runtime.loggers.tracker.Tracker` subclass,
    built as ``Class(run_dir)`` on rank 0."""
    package: str | None = None
    """The optional package its module imports (an import name), or None for none."""
    extra: str | None = None
    """The ``pyproject.toml`` extra that installs ``package``."""

    def __post_init__(self) -> None:
        if (self.package is None) != (self.extra is None):
            raise ValueError(f"tracker {self.name!r}: a package needs the extra installing it")
        if self.build.count(":") != 1:
            raise ValueError(f"tracker {self.name!r}: build is 'module:Class', not {self.build!r}")


TRACKERS: dict[str, TrackerEntry] = {}
"""The trackers by name, in the order they were registered."""


def register_tracker(entry: TrackerEntry) -> TrackerEntry:
    """Add ``entry`` to :data:`TRACKERS` (a name once, never ``jsonl``)."""
    if entry.name == JSONL or entry.name in TRACKERS:
        raise ValueError(f"a logger named {entry.name!r} already exists")
    TRACKERS[entry.name] = entry
    return entry


def logger_names() -> tuple[str, ...]:
    """Every name ``training.loggers`` accepts now: ``jsonl``, then each tracker."""
    return (JSONL, *TRACKERS)


register_tracker(
    TrackerEntry(
        "tensorboard",
        build="factory.runtime.loggers.tensorboard_log:TensorBoardLog",
        package="tensorboard",
        extra="tensorboard",
    )
)
register_tracker(
    TrackerEntry(
        "wandb",
        build="factory.runtime.loggers.wandb_log:WandbLog",
        package="wandb",
        extra="wandb",
    )
)
