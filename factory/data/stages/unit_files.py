"""The intermediate files between stages: one per input file ("unit"), written atomically.

A unit file is a stream of pickled records, in input order, holding what later
stages need: key, exact-dedup hash, MinHash signature, token ids and loss mask.
Beside it, a *sidecar* (``.refs.pkl``) holds the same records without their
tokens, as arrays: keys, token counts, record offsets, exact hashes and
signatures. Dedup (local or the shuffle) and the shard planner read
only the sidecar, so they never unpickle a token array. The stats (counts and
drop reasons) are written last, as JSON; a unit is done when all three exist,
which is what resume checks.
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

from factory.io import naming

__all__ = [
    "CuratedDoc",
    "UnitWriter",
    "read_records",
    "read_sidecar",
    "read_unit",
    "read_unit_stats",
    "save_npy",
    "save_npz",
    "sidecar_path",
    "unit_done",
]


@dataclass(frozen=True)
class CuratedDoc:
    key: str
    content_hash: bytes
    signature: np.ndarray | None
    ids: np.ndarray
    mask: np.ndarray


def sidecar_path(unit: Path) -> Path:
    return unit.with_suffix(".refs.pkl")


def read_sidecar(unit: Path) -> dict[str, Any]:
    """A unit's records without tokens: ``keys`` (list of str), ``lengths`` and ``offsets``
    (int64[n]), ``exact`` (uint8[n, 16] content hashes), ``signed`` (bool[n]: the record has
    a MinHash signature) and ``signatures`` (uint32[n, perm], zeros where not signed; None
    when no record is)."""
    with open(sidecar_path(unit), "rb") as handle:
        return pickle.load(handle)


class UnitWriter:
    """Write a unit's documents to ``path`` via a temporary file; ``close`` publishes them
    with their sidecar and stats."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        self.handle: BinaryIO = open(self.tmp, "wb")  # noqa: SIM115 - closed in close()/abort()
        self.keys: list[str] = []
        self.lengths: list[int] = []
        self.offsets: list[int] = []
        self.hashes: list[bytes] = []
        self.signatures: list[np.ndarray | None] = []

    def write(self, doc: CuratedDoc) -> None:
        self.keys.append(doc.key)
        self.lengths.append(len(doc.ids))
        self.offsets.append(self.handle.tell())
        self.hashes.append(doc.content_hash)
        self.signatures.append(doc.signature)
        with naming(self.path):
            pickle.dump(
                (doc.key, doc.content_hash, doc.signature, doc.ids, doc.mask),
                self.handle,
                protocol=pickle.HIGHEST_PROTOCOL,
            )

    def _sidecar(self) -> dict[str, Any]:
        n = len(self.keys)
        signed = np.asarray([s is not None for s in self.signatures], dtype=bool)
        signatures = None
        if signed.any():
            first = next(s for s in self.signatures if s is not None)
            signatures = np.zeros((n, len(first)), dtype=np.uint32)
            for i in np.flatnonzero(signed).tolist():
                signatures[i] = self.signatures[i]
        return {
            "keys": self.keys,
            "lengths": np.asarray(self.lengths, dtype=np.int64),
            "offsets": np.asarray(self.offsets, dtype=np.int64),
            "exact": np.frombuffer(b"".join(self.hashes), dtype=np.uint8).reshape(n, 16),
            "signed": signed,
            "signatures": signatures,
        }

    def close(self, stats: dict[str, Any]) -> None:
        with naming(self.path):
            self._publish(stats)

    def _publish(self, stats: dict[str, Any]) -> None:
        self.handle.flush()
        os.fsync(self.handle.fileno())
        self.handle.close()
        sidecar = sidecar_path(self.path)
        tmp = sidecar.with_name(sidecar.name + f".tmp{os.getpid()}")
        tmp.write_bytes(pickle.dumps(self._sidecar(), protocol=pickle.HIGHEST_PROTOCOL))
        os.replace(tmp, sidecar)
        os.replace(self.tmp, self.path)
        stats_path = self.path.with_suffix(".json")
        tmp = stats_path.with_name(stats_path.name + f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(stats, sort_keys=True), encoding="utf-8")
        os.replace(tmp, stats_path)

    def abort(self) -> None:
        self.handle.close()
        self.tmp.unlink(missing_ok=True)


def read_unit(path: Path) -> Iterator[CuratedDoc]:
    """A unit's records in file order (their offsets are in the sidecar)."""
    with open(path, "rb") as handle:
        while True:
            try:
                key, digest, signature, ids, mask = pickle.load(handle)
            except EOFError:
                return
            yield CuratedDoc(key, digest, signature, ids, mask)


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


def save_npy(path: Path, array: np.ndarray) -> None:
    """Publish one array as ``path`` (``.npy``) atomically: a temporary sibling, renamed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}.npy")
    with naming(path):
        np.save(tmp, array)
    os.replace(tmp, path)


def save_npz(path: Path, **arrays: np.ndarray) -> None:
    """Publish named arrays as ``path`` (``.npz``) atomically: a temporary sibling, renamed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}.npz")
    with naming(path):
        np.savez(tmp, **arrays)
    os.replace(tmp, path)


def unit_done(path: Path) -> bool:
    # The sidecar too: a unit curated before sidecars existed is curated again.
    return path.with_suffix(".json").is_file() and path.is_file() and sidecar_path(path).is_file()


def read_unit_stats(path: Path) -> dict[str, Any]:
    return json.loads(path.with_suffix(".json").read_text(encoding="utf-8"))
