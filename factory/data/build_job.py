"""``factory.data.build``: run the three stages with resume, workers and progress.

The one data-build job: ``factory data build``, ``factory build`` and
``factory train`` all call :func:`build`.

Layout of the output folder::

    shards/shard-NNNNNN.tar   webdataset shards (tokens, loss mask, cu_seqlens, json)
    .nv-meta/                 Megatron-Energon metadata
    megatron/                 optional indexed .bin/.idx
    quarantine.jsonl          malformed input lines, with their reasons
    manifest.json             recipe hash, counts per step, drop reasons, shard hashes
    .work/                    intermediates (kept for resume; safe to delete afterwards)

Everything written is a function of the recipe, its seed and the inputs, so a
build with any worker count, or one killed and rerun, ends byte-identical.
"""

from __future__ import annotations

import functools
import hashlib
import json
import multiprocessing
import os
import shutil
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from multiprocessing.pool import Pool
from pathlib import Path
from typing import Any

from factory.data.executors.ray_tasks import connect, run_ray_stages
from factory.data.loaded_recipe import LoadedRecipe, load_recipe, with_seq_len
from factory.data.shards.manifest import sha256_file, write_manifest
from factory.data.stages.curate import UnitTask, curate_unit
from factory.data.stages.dedup import dedup_units
from factory.data.stages.mixed_stream import StagesResult, tokens_per_source
from factory.data.stages.mixing import plan_mixture
from factory.data.stages.shard_plan import Runner, plan_and_write
from factory.data.stages.unit_files import read_unit_stats, unit_done
from factory.data.steps.source_files import expand_source_paths
from factory.data.steps.tokenize import DocumentTokenizer
from factory.io import atomic_write_text
from factory.progress import Progress, silent

__all__ = ["EXECUTORS", "build", "recipe_hash"]

EXECUTORS = ("local", "ray")
"""Where the stages run: worker processes on this machine, or Ray tasks."""


def recipe_hash(loaded: LoadedRecipe) -> str:
    """sha256 of the validated recipe: what the manifest records, the same on every machine."""
    canonical = json.dumps(loaded.recipe.model_dump(mode="json"), sort_keys=True)
    return hashlib.sha256(canonical.encode()).hexdigest()


def _tasks(loaded: LoadedRecipe, work: Path) -> list[UnitTask]:
    recipe = loaded.recipe
    tokenizer = loaded.resolve(recipe.tokenizer.path) if recipe.tokenizer.path else None
    benchmarks = tuple(loaded.resolve(b) for b in recipe.decontam.benchmarks)
    tasks = []
    for s_index, source in enumerate(recipe.sources):
        for f_index, path in enumerate(expand_source_paths(loaded.resolve(source.path))):
            output = work / "units" / source.name / f"{f_index:05d}.bin"
            tasks.append(UnitTask(recipe, s_index, f_index, path, output, tokenizer, benchmarks))
    return tasks


def _work_stamp(digest: str, tasks: list[UnitTask]) -> str:
    """The recipe hash plus every input's size and mtime: changed inputs invalidate ``.work``."""
    h = hashlib.sha256(digest.encode())
    for task in tasks:
        stat = task.input_path.stat()
        h.update(f"{task.input_path}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return h.hexdigest()


def _prepare_work(out: Path, digest: str) -> Path:
    """Reuse ``.work`` only if it was made by this exact recipe and inputs; otherwise start clean."""
    work = out / ".work"
    stamp = work / "recipe.sha256"
    if work.exists() and (not stamp.is_file() or stamp.read_text() != digest):
        shutil.rmtree(work)
        for stale in ("shards", ".nv-meta", "megatron", "manifest.json", "quarantine.jsonl"):
            target = out / stale
            if target.is_dir():
                shutil.rmtree(target)
            elif target.exists():
                target.unlink()
    work.mkdir(parents=True, exist_ok=True)
    stamp.write_text(digest)
    # A killed run can leave temporary files behind (never published ones: every
    # write renames into place). Sweep them so the folder holds only real output.
    for folder in (work, out / "shards", out / ".nv-meta", out / "megatron"):
        if folder.is_dir():
            for leftover in folder.rglob("*"):
                if leftover.is_file() and ".tmp" in leftover.name:
                    leftover.unlink()
    return work


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
def _local_runner(workers: int) -> Iterator[Runner]:
    """A :class:`~factory.data.stages.shard_plan.Runner` over ``workers`` forked processes (this
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


def build(
    recipe: str | Path | LoadedRecipe,
    out: Path,
    *,
    workers: int = 1,
    seq_len: int | None = None,
    progress: Progress | None = None,
    keep_work: bool = True,
    executor: str = "local",
    address: str | None = None,
) -> dict[str, Any]:
    """Build (or finish building) the shards of ``recipe`` in ``out``; return the manifest.

    ``recipe`` is a shipped recipe's name, a recipe YAML path or a loaded
    recipe (:func:`~factory.data.loaded_recipe.load_recipe` raises
    ``BlueprintError`` with every problem before any work starts).
    ``seq_len`` packs to that length instead of the recipe's (a blueprint's
    ``data.seq_len`` decides it). ``workers`` processes curate input files in
    parallel; the output is byte-identical for any count. ``progress`` gets
    ``curate``, ``dedup`` and ``shards`` reports. ``keep_work=False`` deletes
    the ``.work`` intermediates afterwards, which gives up resuming.

    ``executor="ray"`` runs the stages as Ray tasks (``factory.data.executors.ray_tasks``)
    on the cluster at ``address`` (or ``RAY_ADDRESS``), or on a Ray instance
    started here with ``workers`` CPUs (all when 1); ``out`` must then be a path
    every node sees. The output is byte-identical to the local executor's.
    """
    loaded = recipe if isinstance(recipe, LoadedRecipe) else load_recipe(recipe)
    if seq_len is not None:
        loaded = with_seq_len(loaded, seq_len)
    if executor not in EXECUTORS:
        raise ValueError(f"executor must be one of {EXECUTORS}, got {executor!r}")
    manifest = _build(loaded, out, workers, progress or silent, executor, address)
    if not keep_work:
        shutil.rmtree(out / ".work", ignore_errors=True)
    return manifest


def _build(
    loaded: LoadedRecipe,
    out: Path,
    workers: int,
    progress: Progress,
    executor: str,
    address: str | None,
) -> dict[str, Any]:
    recipe = loaded.recipe
    digest = recipe_hash(loaded)
    out.mkdir(parents=True, exist_ok=True)
    tasks = _tasks(loaded, out / ".work")
    _prepare_work(out, _work_stamp(digest, tasks))
    units = {
        s.name: [t.output_path for t in tasks if recipe.sources[t.source_index].name == s.name]
        for s in recipe.sources
    }
    tokenizer_path = loaded.resolve(recipe.tokenizer.path) if recipe.tokenizer.path else None
    tokenizer = DocumentTokenizer(tokenizer_path, eos=recipe.tokenizer.eos)
    if executor == "ray":
        with connect(address, workers if workers > 1 else None):
            stages = run_ray_stages(loaded, out, tasks, units, tokenizer, progress)
    else:
        stages = _local_stages(loaded, out, tasks, units, tokenizer, workers, progress)
    manifest = _manifest(loaded, digest, tasks, units, stages, tokenizer)
    _write_quarantine(out, tasks)
    write_manifest(out, manifest)
    return manifest


def _local_stages(
    loaded: LoadedRecipe,
    out: Path,
    tasks: list[UnitTask],
    units: dict[str, list[Path]],
    tokenizer: DocumentTokenizer,
    workers: int,
    progress: Progress,
) -> StagesResult:
    """Curate in worker processes, dedup in this one, then plan and write the shards in the
    workers again (one pool for the whole build)."""
    recipe = loaded.recipe
    order = [t.output_path for t in tasks]
    pending = [(t,) for t in tasks if not unit_done(t.output_path)]
    with _local_runner(workers) as run:
        run(curate_unit, pending, "curate", progress, done=len(tasks) - len(pending))
        dedup = dedup_units(order, recipe.dedup, out / ".work" / "dedup.json")
        progress("dedup", 1, 1)
        plans = plan_mixture(recipe, tokens_per_source(units, dedup))
        return plan_and_write(run, recipe, out, order, units, dedup, plans, tokenizer, progress)


def _write_quarantine(out: Path, tasks: list[UnitTask]) -> None:
    lines = [
        json.dumps(q, sort_keys=True)
        for t in tasks
        for q in read_unit_stats(t.output_path)["quarantine"]
    ]
    atomic_write_text(out / "quarantine.jsonl", "".join(line + "\n" for line in lines))


_ROW = ("documents_in", "tokens_in", "documents_out", "tokens_out")
TOKEN_COUNTS = (
    "tokens are counted from the tokenize step on: the filters and decontamination run "
    "before tokenizing, so their rows count documents only (tokens_in and tokens_out null)"
)


def _manifest(
    loaded: LoadedRecipe,
    digest: str,
    tasks: list[UnitTask],
    units: dict[str, list[Path]],
    stages: StagesResult,
    tokenizer: DocumentTokenizer,
) -> dict[str, Any]:
    recipe, dedup, plans = loaded.recipe, stages.dedup, stages.plans
    sources: dict[str, Any] = {}
    for source in recipe.sources:
        steps: dict[str, dict[str, int]] = {}
        dropped: Counter[str] = Counter()
        quarantined: Counter[str] = Counter()
        for task in tasks:
            if recipe.sources[task.source_index].name != source.name:
                continue
            stats = read_unit_stats(task.output_path)
            for name, row in stats["steps"].items():
                agg = steps.setdefault(name, dict.fromkeys(_ROW, None))
                for k, v in row.items():
                    agg[k] = v + (agg[k] or 0)
            dropped.update(stats["dropped"])
            quarantined.update(stats["quarantined"])
            d = dedup[str(task.output_path)]
            agg = steps.setdefault(
                "dedup", {"documents_in": 0, "tokens_in": 0, "documents_out": 0, "tokens_out": 0}
            )
            for k in agg:
                agg[k] += d[k]
            dropped["dedup:exact"] += d["exact_duplicates"]
            dropped["dedup:near"] += d["near_duplicates"]
        plan = plans[source.name]
        emitted = stages.emitted.get(source.name, {"documents": 0, "tokens": 0})
        steps["mix"] = {
            "documents_in": steps["dedup"]["documents_out"],
            "tokens_in": plan.available_tokens,
            "documents_out": emitted["documents"],
            "tokens_out": emitted["tokens"],
        }
        sources[source.name] = {
            "category": source.category,
            "path": source.path,
            "files": len(units[source.name]),
            "steps": steps,
            "dropped": {k: v for k, v in sorted(dropped.items()) if v},
            "quarantined": dict(sorted(quarantined.items())),
            "mix": {
                "available_tokens": plan.available_tokens,
                "target_tokens": plan.target_tokens,
                "ratio": round(plan.ratio, 6),
                "sampling": "up" if plan.ratio > 1 else ("down" if plan.ratio < 1 else "none"),
            },
            "after": {"documents": emitted["documents"], "tokens": emitted["tokens"]},
        }
    categories: dict[str, dict[str, int]] = {}
    for entry in sources.values():
        agg = categories.setdefault(entry["category"], {"documents": 0, "tokens": 0})
        agg["documents"] += entry["after"]["documents"]
        agg["tokens"] += entry["after"]["tokens"]
    return {
        "recipe": {"name": recipe.name, "sha256": digest, "seed": recipe.seed},
        "token_counts": TOKEN_COUNTS,
        "tokenizer": {"sha256": sha256_file(tokenizer.path), "vocab_size": tokenizer.vocab_size},
        "sources": sources,
        "categories": categories,
        "packing": stages.packing.as_dict(),
        "shards": stages.shards,
    }
