"""``factory.data.build``: run the three stages with resume, workers and progress.

The one data-build job: ``factory data build``, ``factory build`` and
``factory train`` all call :func:`build`. It prepares ``.work``, has an
executor (``executors``) run the stages (``stages.run_stages``), then writes the
quarantine file and the manifest (``build_manifest``).

Layout of the output folder::

    shards/shard-NNNNNN.tar   webdataset shards (tokens, loss mask, cu_seqlens, json)
    .nv-meta/                 Megatron-Energon metadata
    megatron/                 optional indexed .bin/.idx
    heldout/CATEGORY/         each category's held-out documents (a source's ``heldout``):
                              a built folder of its own (``shards.heldout``)
    quarantine.jsonl          malformed input lines: key, reason and input file
    manifest.json             recipe hash, counts per step, drop reasons, shard hashes
    .work/                    intermediates of an unfinished build, for its resume; removed
                              when the build completes (``keep_work`` keeps them)
    .build.lock               one build at a time (``build_lock``); empty when none runs

Everything written is a function of the recipe, its seed and the inputs, so a
build with any worker count, or one killed and rerun, ends byte-identical. A
rerun re-hashes the shards it would skip and rewrites any that changed.

A build that fails on the machine (a full disk) raises ``OSError`` naming the
file it could not write; every file is published by rename, so what a rerun
finds is whole. A build that no document survives publishes no manifest: it
raises ``BuildRefused`` unless ``allow_empty`` asks for an empty one. So does a
record that the recipe's chat template cannot mask (its renders are not prefixes
of each other), naming the record. A held-out split that leaves a source no document
to train on raises ``BlueprintError`` naming the recipe line of that split.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

from factory.data.build_lock import build_lock
from factory.data.build_manifest import build_manifest, heldout_manifests
from factory.data.build_refusals import BuildRefused, empty_build
from factory.data.executors.local_pool import run_local
from factory.data.executors.ray_tasks import connect, run_ray
from factory.data.loaded_recipe import LoadedRecipe, load_recipe, recipe_hash, with_seq_len
from factory.data.shards.heldout import HELDOUT_FOLDER, heldout_folder
from factory.data.shards.manifest import write_manifest
from factory.data.stages.curate import UnitTask
from factory.data.stages.heldout_split import SplitRefused
from factory.data.stages.stage_inputs import StageInputs
from factory.data.stages.unit_files import read_unit_stats
from factory.data.steps.chat_template import ChatTemplateError
from factory.data.steps.source_files import expand_source_paths
from factory.data.steps.tokenize import DocumentTokenizer
from factory.dotted_paths import join_path
from factory.errors import BlueprintError
from factory.io import atomic_write_text, naming
from factory.progress import Progress, silent

__all__ = ["EXECUTORS", "build"]

EXECUTORS = ("local", "ray")
"""Where the stages run: worker processes on this machine, or Ray tasks."""

_STAMP = "recipe.sha256"
"""The file in ``.work`` naming the recipe, inputs and format it was made for."""

WORK_FORMAT = 2
"""The format of ``.work``'s files; part of its stamp, so a ``.work`` of another format is
removed, never read. Format 1 held pickles, which run code when read (``docs/reliability.md``,
"What a folder is trusted with")."""


def _tasks(loaded: LoadedRecipe, work: Path) -> list[UnitTask]:
    recipe = loaded.recipe
    tokenizer = loaded.resolve(recipe.tokenizer.path) if recipe.tokenizer.path else None
    benchmarks = tuple(loaded.resolve(b) for b in recipe.decontam.benchmarks)
    tasks = []
    for s_index, source in enumerate(recipe.sources):
        for f_index, path in enumerate(expand_source_paths(loaded.resolve(source.path))):
            output = work / "units" / source.name / f"{f_index:05d}.bin"
            tasks.append(
                UnitTask(
                    recipe,
                    s_index,
                    f_index,
                    path,
                    output,
                    tokenizer,
                    benchmarks,
                    loaded.chat_template,
                )
            )
    return tasks


def _work_stamp(digest: str, tasks: list[UnitTask]) -> str:
    """The recipe hash plus every input's size and mtime and the work format: changed inputs
    invalidate ``.work``."""
    h = hashlib.sha256(f"{digest}:work-format-{WORK_FORMAT}".encode())
    for task in tasks:
        stat = task.input_path.stat()
        h.update(f"{task.input_path}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return h.hexdigest()


def _prepare_work(out: Path, digest: str) -> Path:
    """Reuse ``.work`` only if it was made by this exact recipe and inputs; otherwise start clean."""
    work = out / ".work"
    stamp = work / _STAMP
    if work.exists() and (not stamp.is_file() or stamp.read_text() != digest):
        shutil.rmtree(work)
        for stale in (
            "shards",
            ".nv-meta",
            "megatron",
            HELDOUT_FOLDER,
            "manifest.json",
            "quarantine.jsonl",
        ):
            target = out / stale
            if target.is_dir():
                shutil.rmtree(target)
            elif target.exists():
                target.unlink()
    work.mkdir(parents=True, exist_ok=True)
    stamp.write_text(digest)
    # A killed run can leave temporary files behind (never published ones: every
    # write renames into place). Sweep them so the folder holds only real output.
    for folder in (work, out / "shards", out / ".nv-meta", out / "megatron", out / HELDOUT_FOLDER):
        if folder.is_dir():
            for leftover in folder.rglob("*"):
                if leftover.is_file() and ".tmp" in leftover.name:
                    leftover.unlink()
    return work


def build(
    recipe: str | Path | LoadedRecipe,
    out: Path,
    *,
    workers: int = 1,
    seq_len: int | None = None,
    progress: Progress | None = None,
    keep_work: bool = False,
    executor: str = "local",
    address: str | None = None,
    allow_empty: bool = False,
) -> dict[str, Any]:
    """Build (or finish building) the shards of ``recipe`` in ``out``; return the manifest.

    ``recipe`` is a shipped recipe's name, a recipe YAML path or a loaded
    recipe (:func:`~factory.data.loaded_recipe.load_recipe` raises
    ``BlueprintError`` with every problem before any work starts).
    ``seq_len`` packs to that length instead of the recipe's (a blueprint's
    ``data.seq_len`` decides it). ``workers`` processes curate input files in
    parallel; the output is byte-identical for any count. ``progress`` gets
    ``curate``, ``dedup`` and ``shards`` reports. A completed build removes its
    ``.work`` intermediates, which only a resume reads (a later rerun re-hashes the
    shards and, for one that changed, curates again); ``keep_work=True`` keeps them.

    ``executor="ray"`` runs the stages as Ray tasks (``factory.data.executors.ray_tasks``)
    on the cluster at ``address`` (or ``RAY_ADDRESS``), or on a Ray instance
    started here with ``workers`` CPUs (all when 1); ``out`` must then be a path
    every node sees. The output is byte-identical to the local executor's.

    One build at a time writes ``out``: a second raises ``BuildRefused``
    (``build_lock``). So does a build that no document survives, unless
    ``allow_empty``: then it publishes a manifest with no shards.
    """
    loaded = recipe if isinstance(recipe, LoadedRecipe) else load_recipe(recipe)
    if seq_len is not None:
        loaded = with_seq_len(loaded, seq_len)
    if executor not in EXECUTORS:
        raise ValueError(f"executor must be one of {EXECUTORS}, got {executor!r}")
    out.mkdir(parents=True, exist_ok=True)
    with build_lock(out):
        # Whatever failed writing without naming its file (numpy, the index writers) is
        # at least named by the folder, so the user knows which disk is full.
        with naming(out):
            manifest = _build(
                loaded, out, workers, progress or silent, executor, address, allow_empty
            )
        if not keep_work:
            _remove_work(out / ".work")
    return manifest


def _remove_work(work: Path) -> None:
    """Remove a finished build's ``.work``, its stamp first: a removal cut short (SIGKILL)
    leaves no stamp, so the next build starts clean instead of trusting what is left (units
    gone, ``dedup.json`` kept: a keep mask missing)."""
    (work / _STAMP).unlink(missing_ok=True)
    shutil.rmtree(work, ignore_errors=True)


def _build(
    loaded: LoadedRecipe,
    out: Path,
    workers: int,
    progress: Progress,
    executor: str,
    address: str | None,
    allow_empty: bool,
) -> dict[str, Any]:
    recipe = loaded.recipe
    digest = recipe_hash(loaded)
    tasks = _tasks(loaded, out / ".work")
    _prepare_work(out, _work_stamp(digest, tasks))
    tokenizer_path = loaded.resolve(recipe.tokenizer.path) if recipe.tokenizer.path else None
    tokenizer = DocumentTokenizer(tokenizer_path, eos=recipe.tokenizer.eos)
    inputs = StageInputs(recipe, out, tasks, tokenizer)
    try:
        if executor == "ray":
            with connect(address, workers if workers > 1 else None):
                stages = run_ray(inputs, progress)
        else:
            stages = run_local(inputs, workers, progress)
    except ChatTemplateError as exc:  # a record whose renders break the prefix rule
        raise BuildRefused(loaded.source, str(exc)) from None
    except SplitRefused as exc:
        raise _split_error(loaded, exc) from None
    manifest = build_manifest(loaded, digest, tasks, stages, tokenizer)
    _write_quarantine(out, tasks)  # written even when refusing: it says what went wrong
    if not manifest["shards"] and not allow_empty:
        raise empty_build(manifest, loaded.source, out / "quarantine.jsonl")
    _write_heldout_manifests(out, heldout_manifests(manifest, stages))
    write_manifest(out, manifest)  # last: it lists held-out sets already published
    return manifest


def _split_error(loaded: LoadedRecipe, refused: SplitRefused) -> BlueprintError:
    """The refusal at the recipe line of each split that left its source nothing to train on
    (the source's own ``heldout``, else the recipe's)."""
    problems = []
    for index, source in enumerate(loaded.recipe.sources):
        if source.name in refused.problems:
            own = join_path(join_path("sources", index), "heldout")
            where = own if source.heldout is not None else "heldout"
            message = f"source {source.name!r}: {refused.problems[source.name]}"
            problems.append(loaded.source_map.diagnostic(where, message))
    return BlueprintError(problems)


def _write_heldout_manifests(out: Path, manifests: dict[str, dict[str, Any]]) -> None:
    """Publish each held-out set's manifest, and remove the folders of categories this build
    holds nothing out of (an earlier build's, finished before the recipe changed)."""
    for category, manifest in manifests.items():
        write_manifest(heldout_folder(out, category), manifest)
    root = out / HELDOUT_FOLDER
    if root.is_dir():
        for folder in root.iterdir():
            if folder.name not in manifests:
                if folder.is_dir():
                    shutil.rmtree(folder)
                else:
                    folder.unlink()
        if not manifests:
            root.rmdir()


def _write_quarantine(out: Path, tasks: list[UnitTask]) -> None:
    """One line per quarantined record: its key, its reason, and the input file it came from
    (the path the recipe's source path resolves to), which the key only numbers."""
    lines = []
    for task in tasks:
        stats = read_unit_stats(task.output_path)
        for line in stats["quarantine"]:
            lines.append(json.dumps({**line, "file": stats["input"]}, sort_keys=True))
    atomic_write_text(out / "quarantine.jsonl", "".join(line + "\n" for line in lines))
