"""What runs a stage's calls: the one interface the two executors implement.

A stage hands a function and its argument tuples to a :class:`Runner`; the local
executor runs them in a process pool (``executors.local_pool``), the Ray one as
Ray tasks (``executors.ray_tasks``). Stage functions take and return only
paths, configs and small counts, so either can run them anywhere.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from factory.progress import Progress

__all__ = ["Runner"]


class Runner(Protocol):
    """Runs ``fn(*args)`` for every call (Ray tasks, or a process pool) and returns the
    results in call order, reporting ``progress(stage, done, total)`` as calls finish."""

    def __call__(
        self,
        fn: Callable[..., Any],
        calls: Sequence[tuple],
        stage: str,
        progress: Progress,
        done: int = 0,
    ) -> list[Any]: ...
