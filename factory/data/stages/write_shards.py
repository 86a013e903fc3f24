"""Stage 3's writes: each shard from its plan, side by side, then Megatron's and Energon's files.

Shard ``i`` is a function of its plan alone (``shard_plan``): its task reads
the planned records by offset, cuts the pieces, packs them into samples and
writes the tar, so shards are written in any order, on any node.
:func:`plan_and_write` runs the whole stage through a runner (``runner``), for the
training shards and, beside them, each category's held-out set: the documents the split
set aside (``heldout_split``), each taken once, packed the same way into a built folder
of its own (``shards.heldout``; no Megatron ``.bin``: validation reads the shards).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from factory.data.shards.energon_metadata import write_energon_dataset
from factory.data.shards.heldout import HELDOUT_FOLDER, heldout_folder
from factory.data.shards.manifest import sha256_file
from factory.data.shards.megatron_index import IndexedDatasetWriter
from factory.data.shards.tar_writer import write_shard
from factory.data.stages.dedup import DedupCounts
from factory.data.stages.heldout_split import Side, SplitCounts
from factory.data.stages.mixed_stream import MixedStream
from factory.data.stages.mixing import SourcePlan
from factory.data.stages.packing import PackingStats, TokenizedDoc, packed_sample
from factory.data.stages.runner import Runner
from factory.data.stages.shard_plan import plan_shards, read_plan
from factory.data.stages.stage_inputs import StageInputs
from factory.data.stages.unit_files import read_records
from factory.io import atomic_write_bytes
from factory.progress import Progress

__all__ = [
    "HeldoutWritten",
    "StagesResult",
    "plan_and_write",
    "write_megatron",
    "write_planned_shard",
]


@dataclass(frozen=True)
class HeldoutWritten:
    """One category's held-out set as written: what each source gave, its shards, packing."""

    emitted: dict[str, dict[str, int]]
    shards: list[dict[str, Any]]
    packing: PackingStats


@dataclass(frozen=True)
class StagesResult:
    """What the manifest needs of the dedup, split, mix, pack and write stages (either
    executor)."""

    dedup: DedupCounts
    plans: dict[str, SourcePlan]
    emitted: dict[str, dict[str, int]]
    shards: list[dict[str, Any]]
    packing: PackingStats
    split: SplitCounts = field(default_factory=dict)
    """Per source with a held-out split: its threshold and what it set aside."""
    heldout: dict[str, HeldoutWritten] = field(default_factory=dict)
    """Per category with held-out documents, in the recipe's order."""


@dataclass(frozen=True)
class _Target:
    """One built folder to plan and write: the training shards, or a held-out set."""

    out: Path
    work: Path
    units: dict[str, list[Path]]
    plans: dict[str, SourcePlan]
    side: Side


def _heldout_targets(inputs: StageInputs, split: SplitCounts) -> dict[str, _Target]:
    """Per category, its held-out documents: every source's once (ratio 1), in recipe order."""
    targets: dict[str, _Target] = {}
    for source in inputs.recipe.sources:
        tokens = split.get(source.name, {}).get("tokens", 0)
        if not tokens:
            continue
        category = source.category
        if category not in targets:
            work = inputs.work / HELDOUT_FOLDER / category
            targets[category] = _Target(
                heldout_folder(inputs.out, category), work, {}, {}, "heldout"
            )
        targets[category].units[source.name] = inputs.units[source.name]
        targets[category].plans[source.name] = SourcePlan(tokens, tokens)
    return targets


def _intact_receipt(shard: Path, receipt_path: Path) -> dict[str, Any] | None:
    """The receipt of a shard already written and still whole, else None (write it again).

    The shard is re-hashed, not just found: a byte flipped since it was
    written must not be skipped into a manifest that ``verify`` then rejects.
    A receipt that is missing or unreadable means the write never finished.
    """
    try:
        receipt = json.loads(receipt_path.read_text(encoding="utf-8"))
        return receipt if sha256_file(shard) == receipt["sha256"] else None
    except (FileNotFoundError, ValueError, KeyError, TypeError):
        return None


def write_planned_shard(
    out: Path, work: Path, index: int, unit_order: list[Path], seq_len: int, pad_id: int
) -> dict[str, Any]:
    """Write shard ``index`` from its plan; return its receipt. Skips a shard already written
    whose bytes still hash to its receipt."""
    name = f"shards/shard-{index:06d}.tar"
    receipt_path = work / "written" / f"shard-{index:06d}.json"
    receipt = _intact_receipt(out / name, receipt_path)
    if receipt is not None:
        return receipt
    planned = read_plan(work, index)
    wanted: dict[int, set[int]] = {}
    for sample in planned:
        for _, unit, offset, _, _ in sample:
            wanted.setdefault(unit, set()).add(offset)
    records = {u: read_records(unit_order[u], offsets) for u, offsets in sorted(wanted.items())}
    samples = []
    for sample in planned:
        pieces = []
        for key, unit, offset, start, end in sample:
            doc = records[unit][offset]
            pieces.append(TokenizedDoc(key, doc.ids[start:end], doc.mask[start:end]))
        samples.append(packed_sample(pieces, seq_len, pad_id))
    digest = write_shard(out / name, samples, index)
    receipt = {
        "name": name,
        "sha256": digest,
        "samples": len(samples),
        "loss_tokens": sum(int(s.loss_mask.sum(dtype="int64")) for s in samples),
    }
    atomic_write_bytes(receipt_path, json.dumps(receipt, sort_keys=True).encode())
    return receipt


def write_megatron(
    units: dict[str, list[Path]],
    plans: dict[str, SourcePlan],
    seed: int,
    prefix: Path,
    vocab_size: int,
) -> None:
    """Megatron's indexed dataset: one ``.bin`` of every mixed document in stream order.

    One file written front to back, so one task: the same stream as the local
    build's, documents (not packed samples), as Megatron's GPT dataset packs
    them itself.
    """
    prefix.parent.mkdir(parents=True, exist_ok=True)
    writer = IndexedDatasetWriter(prefix, vocab_size=vocab_size)
    for doc in MixedStream(units, plans, seed):
        writer.add_document(doc.ids)
    writer.finalize()


def plan_and_write(
    run: Runner,
    inputs: StageInputs,
    dedup: DedupCounts,
    split: SplitCounts,
    plans: dict[str, SourcePlan],
    progress: Progress,
) -> StagesResult:
    """Plan the training shards and each held-out set (one call each), write the held-out
    sets (their shards, one call each, then their Energon metadata), the training shards
    (one call each), then Megatron's ``.bin`` and the training Energon metadata (one call
    each), every call through ``run``. Progress names the held-out writes apart
    (``heldout``), so ``shards`` counts the training shards."""
    recipe, out, work, tokenizer = inputs.recipe, inputs.out, inputs.work, inputs.tokenizer
    units, order = inputs.units, inputs.order
    heldout = _heldout_targets(inputs, split)
    targets = [_Target(out, work, units, plans, "train"), *heldout.values()]
    packing_args = (recipe.packing.seq_len, recipe.packing.window, recipe.output.samples_per_shard)
    summaries = run(
        plan_shards,
        [(t.units, order, t.plans, recipe.seed, *packing_args, t.work, t.side) for t in targets],
        "plan",
        progress,
    )
    (trained, train_summary), *held = zip(targets, summaries, strict=True)
    sets = _write_heldout_sets(run, inputs, held, progress) if held else []
    shards, packing = _write_planned(run, inputs, [(trained, train_summary)], "shards", progress)[0]
    if recipe.output.megatron:
        prefix = out / "megatron" / recipe.name
        call = (units, plans, recipe.seed, prefix, tokenizer.vocab_size)
        run(write_megatron, [call], "megatron", progress)
    if recipe.output.energon:
        call = (out, [s["name"] for s in shards], [s["samples"] for s in shards])
        run(write_energon_dataset, [call], "energon", progress)
    written = {
        category: HeldoutWritten(summary["emitted"], *set_written)
        for category, (_, summary), set_written in zip(heldout, held, sets, strict=True)
    }
    return StagesResult(dedup, plans, train_summary["emitted"], shards, packing, split, written)


_Planned = tuple[_Target, dict[str, Any]]
"""A folder to write and its plan's summary."""


def _write_planned(
    run: Runner, inputs: StageInputs, planned: list[_Planned], stage: str, progress: Progress
) -> list[tuple[list[dict[str, Any]], PackingStats]]:
    """Write the shards of every planned folder (one call each, side by side); per folder,
    its shard entries and packing counts."""
    seq_len, pad_id = inputs.recipe.packing.seq_len, inputs.tokenizer.pad_id
    calls = [
        (target.out, target.work, i, inputs.order, seq_len, pad_id)
        for target, summary in planned
        for i in range(len(summary["samples"]))
    ]
    receipts = run(write_planned_shard, calls, stage, progress)
    written, first = [], 0
    for _, summary in planned:
        own = receipts[first : first + len(summary["samples"])]
        first += len(own)
        packing = PackingStats(**summary["packing"])
        packing.loss_tokens = sum(r["loss_tokens"] for r in own)
        written.append(([{k: r[k] for k in ("name", "sha256", "samples")} for r in own], packing))
    return written


def _write_heldout_sets(
    run: Runner, inputs: StageInputs, planned: list[_Planned], progress: Progress
) -> list[tuple[list[dict[str, Any]], PackingStats]]:
    """The held-out sets: their shards, then (``output.energon``) their Energon metadata."""
    written = _write_planned(run, inputs, planned, "heldout", progress)
    if inputs.recipe.output.energon:
        calls = [
            (target.out, [s["name"] for s in shards], [s["samples"] for s in shards])
            for (target, _), (shards, _) in zip(planned, written, strict=True)
        ]
        run(write_energon_dataset, calls, "heldout energon", progress)
    return written
