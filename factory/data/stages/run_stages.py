"""The stages in order, through one runner: curate, dedup, mix, then plan and write.

Both executors run exactly this (``executors.local_pool``, ``executors.ray_tasks``);
they differ in the runner and in the dedup they pass: the sequential one
(``dedup.dedup_units``) or the shuffle (``dedup_shuffle.shuffle_dedup``), which
reach the same keep masks.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from factory.data.stages.curate import UnitTask, curate_unit
from factory.data.stages.dedup import DedupCounts
from factory.data.stages.mixed_stream import tokens_per_source
from factory.data.stages.mixing import plan_mixture
from factory.data.stages.runner import Runner
from factory.data.stages.unit_files import unit_done
from factory.data.stages.write_shards import StagesResult, plan_and_write
from factory.data.steps.tokenize import DocumentTokenizer
from factory.progress import Progress
from factory.schemas.data_recipe import DataRecipe

__all__ = ["Dedup", "run_stages"]

Dedup = Callable[[list[Path]], DedupCounts]
"""Stage 2 over the units in canonical order: writes their keep masks, returns their counts."""


def run_stages(
    run: Runner,
    dedup: Dedup,
    recipe: DataRecipe,
    out: Path,
    tasks: list[UnitTask],
    units: dict[str, list[Path]],
    tokenizer: DocumentTokenizer,
    progress: Progress,
) -> StagesResult:
    """Curate the units not yet done, dedup them all, mix, then plan and write the shards."""
    pending = [(t,) for t in tasks if not unit_done(t.output_path)]
    run(curate_unit, pending, "curate", progress, done=len(tasks) - len(pending))
    order = [t.output_path for t in tasks]
    counts = dedup(order)
    plans = plan_mixture(recipe, tokens_per_source(units, counts))
    return plan_and_write(run, recipe, out, order, units, counts, plans, tokenizer, progress)
