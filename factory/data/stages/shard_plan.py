"""Stage 3's plan: every shard's samples, packed from the documents' lengths alone.

One call runs the mixed stream (``mixed_stream``) and the packer (``packing``)
over :class:`DocRef` s, a key, a length and where the record lies, read from
the units' sidecars; no token is read. Each shard's plan, the pieces
of each of its samples, goes to ``.work/plan/shard-NNNNNN.json``. Mixing and
packing are sequential by nature (a weighted round robin and windows of
documents in stream order); they touch only metadata, so this pass is cheap.
``write_shards`` then writes the shards from their plans, side by side.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from factory.data.stages.heldout_split import Side
from factory.data.stages.mixed_stream import MixedStream
from factory.data.stages.mixing import SourcePlan
from factory.data.stages.packing import PIECE_SEPARATOR, PackingStats, pack_bins
from factory.data.stages.unit_files import read_sidecar
from factory.io import atomic_write_bytes

__all__ = ["DocRef", "PlannedPiece", "plan_path", "plan_shards", "read_plan"]

PlannedPiece = tuple[str, int, int, int, int]
"""One piece of a planned sample: (key, unit index, record offset, first token, end token)."""


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


def plan_path(work: Path, index: int) -> Path:
    """Where shard ``index``'s plan is kept: a JSON list of samples, each a list of pieces."""
    return work / "plan" / f"shard-{index:06d}.json"


def _write_plan(work: Path, index: int, samples: list[list[PlannedPiece]]) -> None:
    # ensure_ascii: a key's lone surrogate (JSON input may hold one) is written escaped.
    atomic_write_bytes(plan_path(work, index), json.dumps(samples).encode())


def read_plan(work: Path, index: int) -> list[list[PlannedPiece]]:
    """Shard ``index``'s plan, as :func:`plan_shards` wrote it."""
    samples = json.loads(plan_path(work, index).read_text(encoding="utf-8"))
    return [
        [(key, unit, offset, start, end) for key, unit, offset, start, end in sample]
        for sample in samples
    ]


def plan_shards(
    units: dict[str, list[Path]],
    unit_order: list[Path],
    plans: dict[str, SourcePlan],
    seed: int,
    seq_len: int,
    window: int,
    samples_per_shard: int,
    work: Path,
    side: Side = "train",
) -> dict[str, Any]:
    """Plan every shard of the ``side`` documents into ``work/plan``; return (and keep) the
    summary. Resumable."""
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

    stream = MixedStream(units, plans, seed, read=refs, side=side)
    stats = PackingStats()
    shard: list[list[PlannedPiece]] = []
    samples_per: list[int] = []
    for bin_docs in pack_bins(stream, seq_len, window, stats):
        stats.add_bin(len(bin_docs), sum(len(d) for d in bin_docs))
        shard.append([(d.key, d.unit, d.offset, d.start, d.end) for d in bin_docs])
        if len(shard) == samples_per_shard:
            _write_plan(work, len(samples_per), shard)
            samples_per.append(len(shard))
            shard = []
    if shard:
        _write_plan(work, len(samples_per), shard)
        samples_per.append(len(shard))
    summary = {"samples": samples_per, "emitted": stream.emitted, "packing": asdict(stats)}
    atomic_write_bytes(summary_path, json.dumps(summary, sort_keys=True).encode())
    return summary
