"""The data build's stages as Ray tasks (``factory data build --executor ray``).

Each stage is tasks over files on shared storage (an output folder every node
mounts at the same path); the driver submits tasks, counts them done, and
holds nothing per document, so its memory does not grow with the corpus.
Stages, with what runs where (docs/data.md, "On a Ray cluster"):

======================  =====================================================
curate                  one task per input file (``stages.curate.curate_unit``)
dedup map               one task per unit: its sidecar's keys, by partition
dedup reduce            one task per partition: exact duplicates, LSH groups
dedup resolve           one task: keep-first over the groups
dedup mask              one task per unit: keep mask and counts
split                   one task per source with a held-out split: its masks
plan                    one task for the training shards, one per held-out set:
                        mix and pack lengths into shard plans
write                   one task per shard; Megatron ``.bin`` (one task);
                        Energon metadata and the quarantine file (one each)
======================  =====================================================

The stages are the local executor's (``stages.run_stages``), with the dedup as
a shuffle (``stages.dedup_shuffle``). Every task writes its output atomically and
skips work already on disk, and Ray reruns a task whose worker died, so a lost
worker, or a killed driver and a rerun, end with the same bytes. Ray is
imported only here, inside functions (it is an optional dependency).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from factory.data.stages.dedup_shuffle import DEFAULT_PARTITIONS, shuffle_dedup
from factory.data.stages.run_stages import run_stages
from factory.data.stages.stage_inputs import StageInputs
from factory.data.stages.write_shards import StagesResult
from factory.progress import Progress

__all__ = ["connect", "run_all", "run_ray"]


@contextmanager
def connect(address: str | None, num_cpus: int | None) -> Iterator[None]:
    """Use the running Ray (tests), join ``address`` / ``RAY_ADDRESS``, or start one here."""
    try:
        import ray
    except ImportError as error:
        raise RuntimeError(
            "--executor ray needs Ray: pip install 'factory[scale]' (or pip install ray)"
        ) from error
    if ray.is_initialized():
        yield
        return
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=False, logging_level="warning")
    else:
        ray.init(
            num_cpus=num_cpus,
            include_dashboard=False,
            log_to_driver=False,
            logging_level="warning",
        )
    try:
        yield
    finally:
        ray.shutdown()


def run_all(
    fn: Callable[..., Any], calls: Sequence[tuple], stage: str, progress: Progress, done: int = 0
) -> list[Any]:
    """Run ``fn(*args)`` for every call as a Ray task; report each finish; results in order
    (the :class:`~factory.data.stages.runner.Runner` of this executor)."""
    import ray

    remote = ray.remote(fn)
    refs = [remote.remote(*args) for args in calls]
    index = {ref: i for i, ref in enumerate(refs)}
    results: list[Any] = [None] * len(refs)
    total = done + len(refs)
    progress(stage, done, total)
    pending = list(refs)
    while pending:
        ready, pending = ray.wait(pending, num_returns=1)
        for ref in ready:
            results[index[ref]] = ray.get(ref)  # re-raises a task's exception here
            done += 1
        progress(stage, done, total)
    return results


def run_ray(
    inputs: StageInputs, progress: Progress, partitions: int = DEFAULT_PARTITIONS
) -> StagesResult:
    """Curate, dedup, plan and write on the connected Ray cluster."""
    dedup = functools.partial(
        shuffle_dedup,
        run_all,
        config=inputs.recipe.dedup,
        work=inputs.work,
        progress=progress,
        partitions=partitions,
    )
    return run_stages(run_all, dedup, inputs, progress)
