"""Stage 3: mix the curated sources, pack them, and write the shards.

Sources are interleaved by weighted round robin (always take the next
document from the source furthest behind its target share), so every shard
sees the mixture, and it is all streaming: each source is read in order from
its unit files, filtered by its dedup mask, and repeated per ``mixing.repeats``.
Shards are numbered in stream order; one already on disk with the recorded
hash is skipped, so a killed build resumes without rewriting finished work.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Generic

import numpy as np

from factory.data.mixing import SourcePlan, repeats
from factory.data.packing import (
    P,
    PackedSample,
    PackingStats,
    TokenizedDoc,
    pack_best_fit_decreasing,
)
from factory.data.shards import write_shard
from factory.data.stage_dedup import read_keep_mask
from factory.data.unit_io import read_unit

__all__ = ["MixedStream", "StagesResult", "read_tokenized", "tokens_per_source", "write_shards"]


@dataclass(frozen=True)
class StagesResult:
    """What the manifest needs of the dedup, mix, pack and write stages (either executor)."""

    dedup: dict[str, dict]
    plans: dict[str, SourcePlan]
    emitted: dict[str, dict[str, int]]
    shards: list[dict[str, Any]]
    packing: PackingStats


def read_tokenized(unit: Path) -> Iterator[TokenizedDoc]:
    """A unit's documents with their tokens, in file order."""
    for doc in read_unit(unit):
        yield TokenizedDoc(doc.key, doc.ids, doc.mask)


@dataclass
class MixedStream(Generic[P]):
    """The interleaved, repeated documents of all sources, with what each source emitted.

    ``read`` gives a unit's documents in file order: with their tokens by
    default; the Ray planner passes references (key and length) and gets the
    same stream without reading a token.
    """

    units: dict[str, list[Path]]
    plans: dict[str, SourcePlan]
    seed: int
    read: Callable[[Path], Iterable[P]] = read_tokenized  # type: ignore[assignment]
    emitted: dict[str, dict[str, int]] = field(default_factory=dict)

    def _source_docs(self, name: str) -> Iterator[P]:
        ratio = self.plans[name].ratio
        for unit in self.units[name]:
            keep = read_keep_mask(unit)
            for kept, doc in zip(keep, self.read(unit), strict=True):
                if not kept:
                    continue
                for copy in range(repeats(ratio, self.seed, doc.key)):
                    yield doc if copy == 0 else replace(doc, key=f"{doc.key}#{copy}")

    def __iter__(self) -> Iterator[P]:
        streams = {name: self._source_docs(name) for name in self.units}
        self.emitted = {name: {"documents": 0, "tokens": 0} for name in self.units}
        targets = {name: max(plan.target_tokens, 1) for name, plan in self.plans.items()}
        while streams:
            name = min(
                streams,
                key=lambda n: (self.emitted[n]["tokens"] / targets[n], list(self.units).index(n)),
            )
            doc = next(streams[name], None)
            if doc is None:
                del streams[name]
                continue
            self.emitted[name]["documents"] += 1
            self.emitted[name]["tokens"] += len(doc)
            yield doc


def _batches(samples: Iterator[PackedSample], size: int) -> Iterator[list[PackedSample]]:
    batch: list[PackedSample] = []
    for sample in samples:
        batch.append(sample)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def write_shards(
    stream: MixedStream,
    out: Path,
    seq_len: int,
    window: int,
    pad_id: int,
    samples_per_shard: int,
    progress: Callable[[int], None] = lambda _: None,
    on_document: Callable[[np.ndarray], None] | None = None,
) -> tuple[list[dict], PackingStats]:
    """Write ``shards/shard-NNNNNN.tar``; return [{name, sha256, samples}] and packing stats."""
    receipts_path = out / ".work" / "shards.json"
    receipts: dict[str, dict] = (
        json.loads(receipts_path.read_text(encoding="utf-8")) if receipts_path.is_file() else {}
    )
    stats = PackingStats()

    def docs() -> Iterator[TokenizedDoc]:
        doc: TokenizedDoc
        for doc in stream:
            if on_document is not None:
                on_document(doc.ids)
            yield doc

    shards = []
    samples = pack_best_fit_decreasing(docs(), seq_len, window=window, pad_id=pad_id, stats=stats)
    for index, batch in enumerate(_batches(samples, samples_per_shard)):
        name = f"shards/shard-{index:06d}.tar"
        path = out / name
        done = receipts.get(name)
        if done is None or not path.is_file():
            path.parent.mkdir(parents=True, exist_ok=True)
            digest = write_shard(path, batch, index)
            receipts[name] = {"name": name, "sha256": digest, "samples": len(batch)}
            tmp = receipts_path.with_name("shards.json.tmp")
            tmp.write_text(json.dumps(receipts, sort_keys=True), encoding="utf-8")
            os.replace(tmp, receipts_path)
        shards.append(receipts[name])
        progress(index + 1)
    return shards, stats


def tokens_per_source(units: dict[str, Sequence[Path]], dedup: dict[str, dict]) -> dict[str, int]:
    return {name: sum(dedup[str(u)]["tokens_out"] for u in paths) for name, paths in units.items()}
