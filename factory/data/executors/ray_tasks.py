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
plan                    one task: mix and pack lengths into shard plans
write                   one task per shard; Megatron ``.bin`` (one task);
                        Energon metadata and the quarantine file (one each)
======================  =====================================================

Every task writes its output atomically and skips work already on disk, and
Ray reruns a task whose worker died, so a lost worker, or a killed driver and a
rerun, end with the same bytes. Ray is imported only here, inside functions.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from factory.data.loaded_recipe import LoadedRecipe
from factory.data.stages.curate import UnitTask, curate_unit
from factory.data.stages.dedup_shuffle import map_unit, mask_unit, reduce_partition, resolve_groups
from factory.data.stages.mixed_stream import StagesResult, tokens_per_source
from factory.data.stages.mixing import plan_mixture
from factory.data.stages.shard_plan import plan_and_write
from factory.data.stages.unit_files import unit_done
from factory.data.steps.tokenize import DocumentTokenizer
from factory.io import atomic_write_text
from factory.progress import Progress

__all__ = ["connect", "run_ray_stages"]

DEFAULT_PARTITIONS = 16
"""Dedup shuffle partitions: reduce tasks that run side by side (any count gives the same
result; more spreads the reduce over more nodes)."""


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


def _run_all(
    fn: Callable[..., Any], calls: Sequence[tuple], stage: str, progress: Progress, done: int = 0
) -> list[Any]:
    """Run ``fn(*args)`` for every call as a Ray task; report each finish; results in order."""
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


def _one(fn: Callable[..., Any], *args: Any) -> Any:
    return _run_all(fn, [args], fn.__name__, lambda *_: None)[0]


def run_ray_stages(
    loaded: LoadedRecipe,
    out: Path,
    tasks: list[UnitTask],
    units: dict[str, list[Path]],
    tokenizer: DocumentTokenizer,
    progress: Progress,
    partitions: int = DEFAULT_PARTITIONS,
) -> StagesResult:
    """Curate, dedup, plan and write ``tasks`` on the connected Ray cluster."""
    recipe, work = loaded.recipe, out / ".work"
    pending = [(t,) for t in tasks if not unit_done(t.output_path)]
    _run_all(curate_unit, pending, "curate", progress, done=len(tasks) - len(pending))

    order = [t.output_path for t in tasks]
    dedup = _dedup(order, recipe.dedup, work, partitions, progress)
    plans = plan_mixture(recipe, tokens_per_source(units, dedup))
    return plan_and_write(_run_all, recipe, out, order, units, dedup, plans, tokenizer, progress)


def _dedup(
    order: list[Path], config: Any, work: Path, partitions: int, progress: Progress
) -> dict[str, dict]:
    """The shuffle dedup of ``factory.data.stages.dedup_shuffle``; per-unit counts, as locally."""
    marker = work / "dedup.json"
    if marker.is_file():
        progress("dedup", 1, 1)
        return json.loads(marker.read_text(encoding="utf-8"))
    shuffle = work / "shuffle"
    p = partitions
    maps = [(u, i, config, shuffle, p) for i, u in enumerate(order)]
    _run_all(map_unit, maps, "dedup map", progress)
    _run_all(reduce_partition, [(shuffle, i) for i in range(p)], "dedup reduce", progress)
    _one(resolve_groups, shuffle, p)
    masks = [(u, i, shuffle) for i, u in enumerate(order)]
    counts = _run_all(mask_unit, masks, "dedup mask", progress)
    results = {str(unit): row for unit, row in zip(order, counts, strict=True)}
    atomic_write_text(marker, json.dumps(results, sort_keys=True))
    return results
