"""Stage 3 in parallel: plan every shard from lengths, then write shards side by side.

One process mixes, packs and writes in one streaming pass (``mixed_stream``).
Spread over worker processes or Ray tasks, the same bytes come from two steps:

1. **plan** (one task): run the very same mixed stream and packer over
   :class:`DocRef` s, a key, a length and where the record lies, read from the
   units' sidecars; no token is read. Each shard's plan, the pieces of each of
   its samples, goes to ``.work/plan/shard-NNNNNN.pkl``. Mixing and packing
   are sequential by nature (a weighted round robin and windows of documents
   in stream order); they touch only metadata, so this pass is cheap.
2. **write** (one task per shard): read the planned records by offset, cut the
   pieces, materialize the samples and write the tar. Shard ``i`` is a function
   of its plan alone, so shards are written in any order, on any node.
"""

from __future__ import annotations

import json
import pickle
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

from factory.data.shards.energon_metadata import write_energon_dataset
from factory.data.shards.megatron_index import IndexedDatasetWriter
from factory.data.shards.tar_writer import write_shard
from factory.data.stages.dedup_shuffle import read_sidecar
from factory.data.stages.mixed_stream import MixedStream, StagesResult
from factory.data.stages.mixing import SourcePlan
from factory.data.stages.packing import (
    PIECE_SEPARATOR,
    PackingStats,
    TokenizedDoc,
    materialize,
    pack_bins,
)
from factory.data.stages.unit_files import read_records
from factory.data.steps.tokenize import DocumentTokenizer
from factory.io import atomic_write_bytes
from factory.progress import Progress
from factory.schemas.data_recipe import DataRecipe

__all__ = [
    "DocRef",
    "Runner",
    "plan_and_write",
    "plan_shards",
    "write_megatron",
    "write_planned_shard",
]


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


@dataclass(frozen=True)
class DocRef:
    """A document (or a piece of one) by reference: tokens ``start:end`` of a unit's record."""

    key: str
    unit: int
    offset: int
    start: int
    end: int

    def __len__(self) -> int:
        return self.end - self.start

    def piece(self, index: int, start: int, end: int) -> DocRef:
        return DocRef(
            f"{self.key}{PIECE_SEPARATOR}{index}",
            self.unit,
            self.offset,
            self.start + start,
            self.start + end,
        )


def _plan_path(work: Path, index: int) -> Path:
    return work / "plan" / f"shard-{index:06d}.pkl"


def plan_shards(
    units: dict[str, list[Path]],
    unit_order: list[Path],
    plans: dict[str, SourcePlan],
    seed: int,
    seq_len: int,
    window: int,
    samples_per_shard: int,
    work: Path,
) -> dict[str, Any]:
    """Plan every shard into ``work/plan``; return (and keep) the summary. Resumable."""
    summary_path = work / "plan" / "plan.json"
    if summary_path.is_file():
        return json.loads(summary_path.read_text(encoding="utf-8"))
    index_of = {path: i for i, path in enumerate(unit_order)}

    def refs(unit: Path) -> Iterator[DocRef]:
        sidecar = read_sidecar(unit)
        u = index_of[unit]
        for key, length, offset in zip(
            sidecar["keys"], sidecar["lengths"].tolist(), sidecar["offsets"].tolist(), strict=True
        ):
            yield DocRef(key, u, offset, 0, length)

    stream = MixedStream(units, plans, seed, read=refs)
    stats = PackingStats()
    shard: list[list[tuple[str, int, int, int, int]]] = []
    samples_per: list[int] = []
    for bin_docs in pack_bins(stream, seq_len, window, stats):
        stats.add_bin(len(bin_docs), sum(len(d) for d in bin_docs))
        shard.append([(d.key, d.unit, d.offset, d.start, d.end) for d in bin_docs])
        if len(shard) == samples_per_shard:
            atomic_write_bytes(_plan_path(work, len(samples_per)), pickle.dumps(shard))
            samples_per.append(len(shard))
            shard = []
    if shard:
        atomic_write_bytes(_plan_path(work, len(samples_per)), pickle.dumps(shard))
        samples_per.append(len(shard))
    summary = {"samples": samples_per, "emitted": stream.emitted, "packing": asdict(stats)}
    atomic_write_bytes(summary_path, json.dumps(summary, sort_keys=True).encode())
    return summary


def write_planned_shard(
    out: Path, work: Path, index: int, unit_order: list[Path], seq_len: int, pad_id: int
) -> dict[str, Any]:
    """Write shard ``index`` from its plan; return its receipt. Skips a shard already written."""
    name = f"shards/shard-{index:06d}.tar"
    receipt_path = work / "written" / f"shard-{index:06d}.json"
    if receipt_path.is_file() and (out / name).is_file():
        return json.loads(receipt_path.read_text(encoding="utf-8"))
    planned: list[list[tuple[str, int, int, int, int]]] = pickle.loads(
        _plan_path(work, index).read_bytes()
    )
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
        samples.append(materialize(pieces, seq_len, pad_id))
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
    recipe: DataRecipe,
    out: Path,
    order: list[Path],
    units: dict[str, list[Path]],
    dedup: dict[str, dict],
    plans: dict[str, SourcePlan],
    tokenizer: DocumentTokenizer,
    progress: Progress,
) -> StagesResult:
    """Plan the shards (one call), write them (one call each), then Megatron's ``.bin`` and
    Energon's metadata (one call each), every call through ``run``."""
    work = out / ".work"
    summary = run(
        plan_shards,
        [
            (
                units,
                order,
                plans,
                recipe.seed,
                recipe.packing.seq_len,
                recipe.packing.window,
                recipe.output.samples_per_shard,
                work,
            )
        ],
        "plan",
        progress,
    )[0]
    calls = [
        (out, work, i, order, recipe.packing.seq_len, tokenizer.pad_id)
        for i in range(len(summary["samples"]))
    ]
    receipts = run(write_planned_shard, calls, "shards", progress)
    if recipe.output.megatron:
        prefix = out / "megatron" / recipe.name
        call = (units, plans, recipe.seed, prefix, tokenizer.vocab_size)
        run(write_megatron, [call], "megatron", progress)
    shards = [{k: r[k] for k in ("name", "sha256", "samples")} for r in receipts]
    if recipe.output.energon:
        call = (out, [s["name"] for s in shards], [s["samples"] for s in shards])
        run(write_energon_dataset, [call], "energon", progress)
    packing = PackingStats(**summary["packing"])
    packing.loss_tokens = sum(r["loss_tokens"] for r in receipts)
    return StagesResult(dedup, plans, summary["emitted"], shards, packing)
