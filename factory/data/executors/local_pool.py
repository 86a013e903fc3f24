"""The local executor: the stages' calls in a pool of ``workers`` forked processes.

One pool serves the whole build (curate, then plan and write); dedup runs in
this process (``stages.dedup.dedup_units``), sequentially, over the units'
sidecars. ``workers`` <= 1 runs every call here, in order.
"""

from __future__ import annotations

import functools
import multiprocessing
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from multiprocessing.pool import Pool
from pathlib import Path
from typing import Any

from factory.data.stages.dedup import DedupCounts, dedup_units
from factory.data.stages.run_stages import run_stages
from factory.data.stages.runner import Runner
from factory.data.stages.stage_inputs import StageInputs
from factory.data.stages.write_shards import StagesResult
from factory.progress import Progress

__all__ = ["local_runner", "run_local"]


def _one_thread() -> None:
    """Pool initializer: ``tokenizers`` reads this before every parallel batch call."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"


def _apply(job: tuple[int, Callable[..., Any], tuple]) -> tuple[int, Any]:
    index, fn, args = job
    return index, fn(*args)


def _run_calls(
    pool: Pool | None,
    fn: Callable[..., Any],
    calls: Sequence[tuple],
    stage: str,
    progress: Progress,
    done: int = 0,
) -> list[Any]:
    """``fn(*args)`` for every call, in ``pool`` (else here); results in call order."""
    results: list[Any] = [None] * len(calls)
    total = done + len(calls)
    progress(stage, done, total)
    jobs = [(i, fn, args) for i, args in enumerate(calls)]
    finished = map(_apply, jobs) if pool is None else pool.imap_unordered(_apply, jobs)
    for index, result in finished:
        results[index] = result
        done += 1
        progress(stage, done, total)
    return results


@contextmanager
def local_runner(workers: int) -> Iterator[Runner]:
    """A :class:`~factory.data.stages.runner.Runner` over ``workers`` forked processes (this
    process alone when ``workers`` <= 1), kept for every stage of the build."""
    if workers <= 1:
        yield functools.partial(_run_calls, None)
        return
    # fork: workers inherit the imported modules; the tokenizer's Rust thread pool starts
    # only at its first parallel call, which the main process never makes.
    # Each worker tokenizes on one thread: the workers already fill the cores, and
    # a Rust thread pool per worker only makes them contend (measured: 5% slower).
    with multiprocessing.get_context("fork").Pool(workers, initializer=_one_thread) as pool:
        yield functools.partial(_run_calls, pool)


def run_local(inputs: StageInputs, workers: int, progress: Progress) -> StagesResult:
    """Curate in worker processes, dedup in this one, then plan and write the shards in the
    workers again (one pool for the whole build)."""

    def dedup(order: list[Path]) -> DedupCounts:
        counts = dedup_units(order, inputs.recipe.dedup, inputs.work / "dedup.json")
        progress("dedup", 1, 1)
        return counts

    with local_runner(workers) as run:
        return run_stages(run, dedup, inputs, progress)
