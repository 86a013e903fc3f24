"""The stages in order, through one runner: curate, dedup, split, mix, then plan and write.

Both executors run exactly this (``executors.local_pool``, ``executors.ray_tasks``);
they differ in the runner and in the dedup they pass: the sequential one
(``dedup.dedup_units``) or the shuffle (``dedup_shuffle.shuffle_dedup``), which
reach the same keep masks.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from factory.data.stages.curate import curate_unit
from factory.data.stages.dedup import DedupCounts
from factory.data.stages.heldout_split import SplitRefused, split_problems, split_sources
from factory.data.stages.mixed_stream import tokens_per_source
from factory.data.stages.mixing import plan_mixture
from factory.data.stages.runner import Runner
from factory.data.stages.stage_inputs import StageInputs
from factory.data.stages.unit_files import unit_done
from factory.data.stages.write_shards import StagesResult, plan_and_write
from factory.progress import Progress

__all__ = ["Dedup", "run_stages"]

Dedup = Callable[[list[Path]], DedupCounts]
"""Stage 2 over the units in canonical order: writes their keep masks, returns their counts."""


def run_stages(run: Runner, dedup: Dedup, inputs: StageInputs, progress: Progress) -> StagesResult:
    """Curate the units not yet done, dedup them all, set the held-out documents aside, mix,
    then plan and write the training shards and the held-out sets.

    Raises :class:`~factory.data.stages.heldout_split.SplitRefused` before any shard is
    written when a split leaves a source nothing to train on.
    """
    pending = [(t,) for t in inputs.tasks if not unit_done(t.output_path)]
    run(curate_unit, pending, "curate", progress, done=len(inputs.tasks) - len(pending))
    counts = dedup(inputs.order)
    split = split_sources(run, inputs.recipe, inputs.units, inputs.work, progress)
    if problems := split_problems(split):
        raise SplitRefused(problems)
    plans = plan_mixture(inputs.recipe, tokens_per_source(inputs.units, counts, split))
    return plan_and_write(run, inputs, counts, split, plans, progress)
