"""Energon's random-access index for our shards, written without megatron-energon.

``energon prepare`` (megatron-energon 7.4.1) adds three things beside the
``.nv-meta`` yaml files, and its loader needs them (``get_train_dataset`` fails
without the ``.tar.idx`` files):

* ``shards/X.tar.idx`` per shard: one unsigned 64-bit integer per sample, the
  byte offset of the sample's first tar header, then the offset where the
  archive's end-of-file blocks start. Energon packs them with ``struct`` "Q",
  i.e. native order; we write little-endian, which is that on every platform
  Energon runs on (x86-64, aarch64).
* ``.nv-meta/index.sqlite``: table ``samples`` (one row per sample: shard
  position, key, index in shard, byte offset and size) and ``sample_parts``
  (one row per tar member: content offset and size), with Energon's DDL and
  indexes verbatim. Energon uses it for lookups by key (joins, random access).
* ``.nv-meta/index.uuid``: the dataset's identity, which Energon mixes into
  join-index cache keys. ``energon prepare`` draws it at random; ours is a
  uuid5 of a sha256 over everything indexed, so it changes exactly when the
  index does.

Everything is derived from the tar headers on disk (as ``energon prepare``
does), so a resumed build that reused old shards gets the same files as a
fresh one. ``index.sqlite`` is byte-identical across builds for a given
SQLite library: the same statements run in one transaction with pinned page
size, encoding and vacuum mode; the file header records the version of the
SQLite library that wrote it, so another SQLite release may give other bytes
for the same rows.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sqlite3
import struct
import tarfile
import tempfile
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from factory.data.shards.tar_reader import file_listing
from factory.io import atomic_write_bytes, atomic_write_text

__all__ = [
    "INDEX_SQLITE",
    "INDEX_UUID",
    "META_DIR",
    "TAR_INDEX_SUFFIX",
    "ShardIndex",
    "check_energon_index",
    "scan_shard",
    "write_energon_index",
]

META_DIR = ".nv-meta"
INDEX_SQLITE = "index.sqlite"
INDEX_UUID = "index.uuid"
TAR_INDEX_SUFFIX = ".tar.idx"

# Energon's rules for which tar members form a sample (flavors/webdataset/config.py).
_SPLIT_NAME = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")
_SKIP_META = re.compile(r"__[^/]*__($|/)")

# The DDL of Energon's SqliteIndexWriter, verbatim: the stored schema text is
# part of the file, and a reader comparing schemas sees Energon's own.
_CREATE_SAMPLES = """
                CREATE TABLE IF NOT EXISTS samples (
                    tar_file_id INTEGER NOT NULL,
                    sample_key TEXT NOT NULL UNIQUE,
                    sample_index INTEGER NOT NULL,
                    byte_offset INTEGER,
                    byte_size INTEGER
                )
                """
_CREATE_PARTS = """
                CREATE TABLE IF NOT EXISTS sample_parts (
                    tar_file_id INTEGER,
                    sample_index INTEGER,
                    part_name TEXT,
                    content_byte_offset INTEGER,
                    content_byte_size INTEGER
                )
                """
_CREATE_INDEXES = (
    "CREATE INDEX IF NOT EXISTS idx_samples_by_tar_and_idx ON samples(tar_file_id, sample_index)",
    "CREATE INDEX IF NOT EXISTS idx_sample_parts_seq"
    " ON sample_parts(tar_file_id, sample_index, content_byte_offset)",
    "CREATE INDEX IF NOT EXISTS idx_sample_parts_full ON sample_parts(tar_file_id, sample_index,"
    " part_name, content_byte_offset, content_byte_size)",
)
_UUID_NAMESPACE = uuid.uuid5(uuid.NAMESPACE_URL, "factory:energon-index")


@dataclass
class ShardIndex:
    """What Energon indexes of one shard, in tar order."""

    name: str
    offsets: list[int] = field(default_factory=list)
    """Start of each sample's first header, then the end of the last member."""
    samples: list[tuple[str, int, int]] = field(default_factory=list)
    """(key, byte offset, byte size) per sample."""
    parts: list[tuple[int, str, int, int]] = field(default_factory=list)
    """(sample index, part name, content offset, content size) per member."""

    def tar_idx_bytes(self) -> bytes:
        return struct.pack(f"<{len(self.offsets)}Q", *self.offsets)


def scan_shard(path: Path, name: str) -> ShardIndex:
    """Read the tar headers of ``path`` (not the data) as ``energon prepare`` does, through the
    one tar reader (``tar_reader.file_listing``: straight from the headers for our plain USTAR
    shards, through ``tarfile`` for anything else)."""
    members, end = file_listing(path)
    index = ShardIndex(name)
    last_key: str | None = None
    for member in members:
        if _SKIP_META.match(member.name):
            continue
        match = _SPLIT_NAME.match(member.name)
        if match is None:
            continue
        key, part = match.group(1), match.group(2)
        if key != last_key:
            index.offsets.append(member.offset)
            index.samples.append((key, member.offset, 0))
            last_key = key
        index.parts.append((len(index.samples) - 1, part, member.offset_data, member.size))
    index.offsets.append(end)  # where the last sample ends, the value Energon appends
    index.samples = [
        (key, start, end - start)
        for (key, start, _), end in zip(index.samples, index.offsets[1:], strict=True)
    ]
    return index


def _content_uuid(indexes: list[ShardIndex]) -> str:
    digest = hashlib.sha256()
    for index in indexes:
        rows = {"name": index.name, "samples": index.samples, "parts": index.parts}
        digest.update(json.dumps(rows, separators=(",", ":")).encode())
        digest.update(index.tar_idx_bytes())
    return str(uuid.uuid5(_UUID_NAMESPACE, digest.hexdigest()))


def _write_sqlite(path: Path, indexes: list[ShardIndex]) -> None:
    """Build ``index.sqlite`` in a temporary sibling, then rename it into place."""
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        # isolation_level=None: our explicit BEGIN/COMMIT is the only
        # transaction, so the header's change counter is always the same.
        db = sqlite3.connect(tmp, isolation_level=None)
        try:
            # Pin what a build's defaults could change; an in-memory journal
            # leaves no side file (the temporary file is discarded on failure).
            for pragma in ("page_size = 4096", "auto_vacuum = NONE", "encoding = 'UTF-8'"):
                db.execute(f"PRAGMA {pragma}")
            db.execute("PRAGMA journal_mode = MEMORY")
            db.execute("BEGIN")
            db.execute(_CREATE_SAMPLES)
            db.execute(_CREATE_PARTS)
            for tar_id, index in enumerate(indexes):
                db.executemany(
                    "INSERT INTO samples (tar_file_id, sample_key, sample_index, byte_offset,"
                    " byte_size) VALUES (?, ?, ?, ?, ?)",
                    (
                        (tar_id, key, i, start, size)
                        for i, (key, start, size) in enumerate(index.samples)
                    ),
                )
                db.executemany(
                    "INSERT INTO sample_parts (tar_file_id, sample_index, part_name,"
                    " content_byte_offset, content_byte_size) VALUES (?, ?, ?, ?, ?)",
                    ((tar_id, *part) for part in index.parts),
                )
            for statement in _CREATE_INDEXES:
                db.execute(statement)
            db.execute("COMMIT")
        finally:
            db.close()
        with open(tmp, "rb+") as handle:
            os.fsync(handle.fileno())
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(tmp, 0o644 & ~mask)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _scan_all(out: Path, shard_names: list[str]) -> list[ShardIndex]:
    return [scan_shard(out / name, name) for name in shard_names]


def write_energon_index(
    out: Path, shard_names: list[str], sample_counts: list[int] | None = None
) -> None:
    """Write every shard's ``.tar.idx`` and ``.nv-meta/{index.sqlite, index.uuid}``, atomically.

    ``sample_counts`` (what the manifest promises) is checked against the tars:
    an index over shards that disagree with ``.info.json`` would mislead Energon.
    """
    out = Path(out)
    indexes = _scan_all(out, shard_names)
    if sample_counts is not None:
        found = [len(index.samples) for index in indexes]
        if found != [int(c) for c in sample_counts]:
            raise ValueError(f"shards hold {found} samples, expected {list(sample_counts)}")
    keys = [key for index in indexes for key, _, _ in index.samples]
    if len(set(keys)) != len(keys):
        raise ValueError("sample keys repeat across shards; Energon requires unique keys")
    for index in indexes:
        target = out / (index.name.removesuffix(".tar") + TAR_INDEX_SUFFIX)
        data = index.tar_idx_bytes()
        # A rerun finds most files already right: skip rewriting them.
        if not target.is_file() or target.read_bytes() != data:
            atomic_write_bytes(target, data)
    meta = out / META_DIR
    meta.mkdir(parents=True, exist_ok=True)
    _write_sqlite(meta / INDEX_SQLITE, indexes)
    atomic_write_text(meta / INDEX_UUID, _content_uuid(indexes))


def _sqlite_rows(path: Path) -> tuple[list[tuple], list[tuple]]:
    db = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
    try:
        samples = db.execute(
            "SELECT tar_file_id, sample_key, sample_index, byte_offset, byte_size"
            " FROM samples ORDER BY rowid"
        ).fetchall()
        parts = db.execute(
            "SELECT tar_file_id, sample_index, part_name, content_byte_offset, content_byte_size"
            " FROM sample_parts ORDER BY rowid"
        ).fetchall()
    finally:
        db.close()
    return samples, parts


def check_energon_index(out: Path) -> list[str]:
    """Problems with the Energon index of a built folder; empty when Energon can load it.

    Recomputes everything from the tars named in ``.info.json`` and names each
    missing or stale ``.tar.idx``, ``index.sqlite`` and ``index.uuid``.
    """
    out = Path(out)
    info_path = out / META_DIR / ".info.json"
    try:
        names = list(json.loads(info_path.read_text(encoding="utf-8"))["shard_counts"])
    except (OSError, ValueError, KeyError, TypeError) as error:
        return [f"{META_DIR}/.info.json: unreadable ({error})"]
    problems: list[str] = []
    indexes: list[ShardIndex] = []
    for name in names:
        try:
            indexes.append(scan_shard(out / name, name))
        except (OSError, tarfile.TarError) as error:
            problems.append(f"{name}: unreadable ({error})")
    if problems:
        return problems
    for index in indexes:
        rel = index.name.removesuffix(".tar") + TAR_INDEX_SUFFIX
        path = out / rel
        if not path.is_file():
            problems.append(f"{rel}: missing")
        elif path.read_bytes() != index.tar_idx_bytes():
            problems.append(f"{rel}: stale")
    sqlite_path = out / META_DIR / INDEX_SQLITE
    if not sqlite_path.is_file():
        problems.append(f"{META_DIR}/{INDEX_SQLITE}: missing")
    else:
        want_samples = [
            (t, key, i, start, size)
            for t, index in enumerate(indexes)
            for i, (key, start, size) in enumerate(index.samples)
        ]
        want_parts = [(t, *part) for t, index in enumerate(indexes) for part in index.parts]
        try:
            if _sqlite_rows(sqlite_path) != (want_samples, want_parts):
                problems.append(f"{META_DIR}/{INDEX_SQLITE}: stale")
        except sqlite3.Error as error:
            problems.append(f"{META_DIR}/{INDEX_SQLITE}: unreadable ({error})")
    uuid_path = out / META_DIR / INDEX_UUID
    if not uuid_path.is_file():
        problems.append(f"{META_DIR}/{INDEX_UUID}: missing")
    elif uuid_path.read_text(encoding="utf-8") != _content_uuid(indexes):
        problems.append(f"{META_DIR}/{INDEX_UUID}: stale")
    return problems
