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
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from factory.data.mixing import SourcePlan, repeats
from factory.data.packing import PackedSample, PackingStats, TokenizedDoc, pack_best_fit_decreasing
from factory.data.shards import write_shard
from factory.data.stage_dedup import read_keep_mask
from factory.data.unit_io import read_unit

__all__ = ["MixedStream", "write_shards"]


@dataclass
class MixedStream:
    """The interleaved, repeated documents of all sources, with what each source emitted."""

    units: dict[str, list[Path]]
    plans: dict[str, SourcePlan]
    seed: int
    emitted: dict[str, dict[str, int]] = field(default_factory=dict)

    def _source_docs(self, name: str) -> Iterator[TokenizedDoc]:
        ratio = self.plans[name].ratio
        for unit in self.units[name]:
            keep = read_keep_mask(unit)
            for kept, doc in zip(keep, read_unit(unit), strict=True):
                if not kept:
                    continue
                for copy in range(repeats(ratio, self.seed, doc.key)):
                    key = doc.key if copy == 0 else f"{doc.key}#{copy}"
                    yield TokenizedDoc(key, doc.ids, doc.mask)

    def __iter__(self) -> Iterator[TokenizedDoc]:
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
            self.emitted[name]["tokens"] += len(doc.ids)
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
