"""The intermediate files between stages: one per input file ("unit"), written atomically.

A unit file is a stream of records, in input order, holding what later stages
need: key, exact-dedup hash, MinHash signature, token ids and loss mask. Each
record is a fixed little-endian head (key bytes, tokens, signature length or
-1 for none) and then its raw arrays, signature (``<u4``), ids (``<i4``) and
mask (``u1``) first so that they lie aligned in the record's buffer, then the
16-byte hash and the key (UTF-8). Beside it, a *sidecar* (``.refs``) holds
the same records without their tokens, as arrays: keys, token counts, record
offsets, exact hashes and signatures. Dedup (local or the shuffle) and the
shard planner read only the sidecar, so they never read a token array. The
stats (counts and drop reasons) are written last, as JSON; a unit is done when
all three exist, which is what resume checks.

Nothing here is a pickle: a shared output folder is a shared trust boundary,
and these files are read back by whoever resumes the build, so they hold
numbers, bytes and text that no reader turns into code (``np.load`` with
``allow_pickle=False``).
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from itertools import pairwise
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

_HEAD = struct.Struct("<IIi")
"""A record's head: key bytes, tokens, signature length (-1: the record has none)."""
_HASH_BYTES = 16
_TEXT = ("utf-8", "surrogatepass")
"""Keys come from JSON, which may hold lone surrogates; they round-trip as they are."""


@dataclass(frozen=True)
class CuratedDoc:
    key: str
    content_hash: bytes
    signature: np.ndarray | None
    ids: np.ndarray
    mask: np.ndarray


def sidecar_path(unit: Path) -> Path:
    return unit.with_suffix(".refs")


_SIDECAR = ("key_text", "key_ends", "lengths", "offsets", "exact", "signed", "signatures")
"""A sidecar's arrays, in file order, each one ``.npy`` record after the other: one file
read in one pass (a zipped ``.npz`` would also check each array's CRC)."""


def read_sidecar(unit: Path) -> dict[str, Any]:
    """A unit's records without tokens: ``keys`` (list of str), ``lengths`` and ``offsets``
    (int64[n]), ``exact`` (uint8[n, 16] content hashes), ``signed`` (bool[n]: the record has
    a MinHash signature) and ``signatures`` (uint32[n, perm], zeros where not signed; None
    when no record is)."""
    with open(sidecar_path(unit), "rb") as handle:
        arrays = {name: np.load(handle, allow_pickle=False) for name in _SIDECAR}
    text = arrays.pop("key_text").tobytes().decode(*_TEXT)
    ends = arrays.pop("key_ends").tolist()
    arrays["keys"] = [text[a:b] for a, b in pairwise([0, *ends])]
    if not arrays["signed"].any():
        arrays["signatures"] = None
    return arrays


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
        key = doc.key.encode(*_TEXT)
        ids = np.ascontiguousarray(doc.ids, dtype="<i4")
        mask = np.ascontiguousarray(doc.mask, dtype="u1")
        signature = None if doc.signature is None else np.ascontiguousarray(doc.signature, "<u4")
        if len(doc.content_hash) != _HASH_BYTES or len(mask) != len(ids):
            raise ValueError(
                f"{doc.key}: a {len(doc.content_hash)}-byte hash and {len(mask)} mask values "
                f"for {len(ids)} tokens (want {_HASH_BYTES} bytes and one value per token)"
            )
        self.keys.append(doc.key)
        self.lengths.append(len(ids))
        self.offsets.append(self.handle.tell())
        self.hashes.append(doc.content_hash)
        self.signatures.append(signature)
        parts = [_HEAD.pack(len(key), len(ids), -1 if signature is None else len(signature))]
        if signature is not None:
            parts.append(signature.tobytes())
        parts += [ids.tobytes(), mask.tobytes(), doc.content_hash, key]
        with naming(self.path):
            self.handle.write(b"".join(parts))

    def _sidecar(self) -> dict[str, np.ndarray]:
        n = len(self.keys)
        signed = np.asarray([s is not None for s in self.signatures], dtype=bool)
        perm = next((len(s) for s in self.signatures if s is not None), 0)
        signatures = np.zeros((n, perm), dtype=np.uint32)
        for i in np.flatnonzero(signed).tolist():
            signatures[i] = self.signatures[i]
        return {
            # The keys joined, and where each ends (in characters: one decode, then slices).
            "key_text": np.frombuffer("".join(self.keys).encode(*_TEXT), dtype=np.uint8),
            "key_ends": np.cumsum([len(k) for k in self.keys], dtype=np.int64),
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
        arrays = self._sidecar()
        with open(tmp, "wb") as handle:
            for name in _SIDECAR:
                np.save(handle, arrays[name], allow_pickle=False)
        os.replace(tmp, sidecar)
        os.replace(self.tmp, self.path)
        stats_path = self.path.with_suffix(".json")
        tmp = stats_path.with_name(stats_path.name + f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(stats, sort_keys=True), encoding="utf-8")
        os.replace(tmp, stats_path)

    def abort(self) -> None:
        self.handle.close()
        self.tmp.unlink(missing_ok=True)


def _read_record(handle: BinaryIO, path: Path, end: int) -> CuratedDoc | None:
    """The record at the handle's position (None at the end of the file, ``end`` bytes long);
    its arrays are views of one writable buffer."""
    head = handle.read(_HEAD.size)
    if not head:
        return None
    key_bytes, tokens, signed = _HEAD.unpack(head) if len(head) == _HEAD.size else (0, 0, 0)
    perm = max(signed, 0)
    size = 4 * perm + 5 * tokens + _HASH_BYTES + key_bytes
    # The sizes are checked against the file before anything that large is allocated.
    if len(head) != _HEAD.size or size > end - handle.tell():
        raise ValueError(f"{path}: a record cut short at byte {handle.tell() - len(head)}")
    body = bytearray(size)
    handle.readinto(body)
    signature = np.frombuffer(body, "<u4", perm) if signed >= 0 else None
    at = 4 * perm
    ids = np.frombuffer(body, "<i4", tokens, at)
    at += 4 * tokens
    mask = np.frombuffer(body, "u1", tokens, at)
    at += tokens
    digest = bytes(body[at : at + _HASH_BYTES])
    key = body[at + _HASH_BYTES :].decode(*_TEXT)
    return CuratedDoc(key, digest, signature, ids, mask)


def read_unit(path: Path) -> Iterator[CuratedDoc]:
    """A unit's records in file order (their offsets are in the sidecar)."""
    with open(path, "rb") as handle:
        end = os.fstat(handle.fileno()).st_size
        while (doc := _read_record(handle, path, end)) is not None:
            yield doc


def read_records(path: Path, offsets: Iterable[int]) -> dict[int, CuratedDoc]:
    """The records starting at ``offsets``, read by seeking (offsets in ascending order
    keep the reads sequential)."""
    found: dict[int, CuratedDoc] = {}
    with open(path, "rb") as handle:
        end = os.fstat(handle.fileno()).st_size
        for offset in sorted(set(offsets)):
            handle.seek(offset)
            doc = _read_record(handle, path, end)
            if doc is None:
                raise ValueError(f"{path}: no record at byte {offset}, past its end")
            found[offset] = doc
    return found


def save_npy(path: Path, array: np.ndarray) -> None:
    """Publish one array as ``path`` (``.npy``) atomically: a temporary sibling, renamed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}.npy")
    with naming(path):
        np.save(tmp, array, allow_pickle=False)
    os.replace(tmp, path)


def save_npz(path: Path, **arrays: np.ndarray) -> None:
    """Publish named arrays as ``path`` (``.npz``) atomically: a temporary sibling, renamed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}.npz")
    with naming(path):
        np.savez(tmp, **arrays)
    os.replace(tmp, path)


def unit_done(path: Path) -> bool:
    return path.with_suffix(".json").is_file() and path.is_file() and sidecar_path(path).is_file()


def read_unit_stats(path: Path) -> dict[str, Any]:
    return json.loads(path.with_suffix(".json").read_text(encoding="utf-8"))
