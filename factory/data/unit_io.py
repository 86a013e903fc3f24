"""The intermediate files between stages: one per input file ("unit"), written atomically.

A unit file is a stream of pickled records, in input order, holding what later
stages need: key, exact-dedup hash, MinHash signature, token ids and loss mask.
Its stats (counts and drop reasons) sit beside it as JSON, written after the
data; a unit is done when its stats file exists, which is what resume checks.
"""

from __future__ import annotations

import json
import os
import pickle
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

__all__ = [
    "CuratedDoc",
    "UnitWriter",
    "read_records",
    "read_unit",
    "read_unit_stats",
    "read_unit_with_offsets",
    "unit_done",
]


@dataclass(frozen=True)
class CuratedDoc:
    key: str
    content_hash: bytes
    signature: np.ndarray | None
    ids: np.ndarray
    mask: np.ndarray


class UnitWriter:
    """Write a unit's documents to ``path`` via a temporary file; ``close`` publishes them."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        self.handle: BinaryIO = open(self.tmp, "wb")  # noqa: SIM115 - closed in close()/abort()

    def write(self, doc: CuratedDoc) -> None:
        pickle.dump(
            (doc.key, doc.content_hash, doc.signature, doc.ids, doc.mask),
            self.handle,
            protocol=pickle.HIGHEST_PROTOCOL,
        )

    def close(self, stats: dict[str, Any]) -> None:
        self.handle.flush()
        os.fsync(self.handle.fileno())
        self.handle.close()
        os.replace(self.tmp, self.path)
        stats_path = self.path.with_suffix(".json")
        tmp = stats_path.with_name(stats_path.name + f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(stats, sort_keys=True), encoding="utf-8")
        os.replace(tmp, stats_path)

    def abort(self) -> None:
        self.handle.close()
        self.tmp.unlink(missing_ok=True)


def read_unit(path: Path) -> Iterator[CuratedDoc]:
    for _, doc in read_unit_with_offsets(path):
        yield doc


def read_unit_with_offsets(path: Path) -> Iterator[tuple[int, CuratedDoc]]:
    """Each record with the byte offset it starts at (for :func:`read_records`)."""
    with open(path, "rb") as handle:
        while True:
            offset = handle.tell()
            try:
                key, digest, signature, ids, mask = pickle.load(handle)
            except EOFError:
                return
            yield offset, CuratedDoc(key, digest, signature, ids, mask)


def read_records(path: Path, offsets: Iterable[int]) -> dict[int, CuratedDoc]:
    """The records starting at ``offsets``, read by seeking (offsets in ascending order
    keep the reads sequential)."""
    found: dict[int, CuratedDoc] = {}
    with open(path, "rb") as handle:
        for offset in sorted(set(offsets)):
            handle.seek(offset)
            key, digest, signature, ids, mask = pickle.load(handle)
            found[offset] = CuratedDoc(key, digest, signature, ids, mask)
    return found


def unit_done(path: Path) -> bool:
    return path.with_suffix(".json").is_file() and path.is_file()


def read_unit_stats(path: Path) -> dict[str, Any]:
    return json.loads(path.with_suffix(".json").read_text(encoding="utf-8"))
