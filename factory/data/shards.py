"""Deterministic webdataset shards: identical samples always give byte-identical tar files.

Why byte-identical: the manifest records each shard's sha256, so a rebuild can
prove it reproduced a shard, ``verify`` can catch corruption, and a resumed
build can skip shards whose hash already matches. Everything that tar would
otherwise take from the environment (time, owner, umask, member order) is
fixed here.

Layout of one shard (USTAR tar, members in this order for each sample ``i``,
key ``f"{shard_index:06d}{i:06d}"``; webdataset groups members by the part of
the name before the first dot, so keys contain none):

* ``{key}.tokens.npy``: int32 [seq_len] (``np.save``, little-endian, no pickle)
* ``{key}.loss_mask.npy``: uint8 [seq_len]
* ``{key}.cu_seqlens.npy``: int32 [n_docs + 1]
* ``{key}.json``: ``{"doc_keys": [...]}``, sorted keys, compact separators

The file is written to a temporary sibling, fsynced and renamed into place, so
a reader (or a crash) never sees half a shard under the final name.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import tarfile
import tempfile
from pathlib import Path
from typing import BinaryIO

import numpy as np

from factory.data.packing import PackedSample

__all__ = ["MAX_SAMPLES_PER_SHARD", "read_shard", "sample_key", "write_shard"]

MAX_SAMPLES_PER_SHARD = 1_000_000
"""The sample index takes six digits of the key."""

_FIELDS: tuple[tuple[str, str, np.dtype], ...] = (
    ("tokens.npy", "tokens", np.dtype("<i4")),
    ("loss_mask.npy", "loss_mask", np.dtype("u1")),
    ("cu_seqlens.npy", "cu_seqlens", np.dtype("<i4")),
)


def sample_key(shard_index: int, i: int) -> str:
    """The webdataset key of sample ``i`` of shard ``shard_index``: 12 digits, no dots."""
    if not 0 <= shard_index < 1_000_000:
        raise ValueError(f"shard_index must be in [0, 1e6), got {shard_index}")
    if not 0 <= i < MAX_SAMPLES_PER_SHARD:
        raise ValueError(f"sample index must be in [0, {MAX_SAMPLES_PER_SHARD}), got {i}")
    return f"{shard_index:06d}{i:06d}"


def _npy_bytes(array: np.ndarray, dtype: np.dtype) -> bytes:
    """``.npy`` bytes of ``array`` in a fixed dtype and C order (the header then never varies)."""
    buffer = io.BytesIO()
    np.save(buffer, np.ascontiguousarray(array, dtype=dtype), allow_pickle=False)
    return buffer.getvalue()


def _json_bytes(sample: PackedSample) -> bytes:
    text = json.dumps({"doc_keys": list(sample.doc_keys)}, sort_keys=True, separators=(",", ":"))
    return text.encode("utf-8")


def _member(name: str, size: int) -> tarfile.TarInfo:
    """A regular-file header with every environment-dependent field pinned."""
    info = tarfile.TarInfo(name)
    info.size = size
    info.mtime = 0
    info.mode = 0o644
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    info.type = tarfile.REGTYPE
    return info


class _HashingWriter:
    """File wrapper that hashes bytes on their way to disk, sparing a second read."""

    def __init__(self, raw: BinaryIO) -> None:
        self._raw = raw
        self.digest = hashlib.sha256()

    def write(self, data: bytes) -> int:
        self.digest.update(data)
        return self._raw.write(data)

    def tell(self) -> int:
        return self._raw.tell()

    def flush(self) -> None:
        self._raw.flush()


def _fsync_dir(directory: Path) -> None:
    """Persist a rename; best effort where directories cannot be opened (Windows)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_shard(path: Path, samples: list[PackedSample], shard_index: int) -> str:
    """Write ``samples`` as one webdataset tar at ``path``; return the file's sha256 hex.

    An existing file at ``path`` is replaced only once the new one is complete;
    if anything fails the temporary file is removed and ``path`` is untouched.
    """
    path = Path(path)
    if len(samples) > MAX_SAMPLES_PER_SHARD:
        raise ValueError(f"{len(samples)} samples exceed {MAX_SAMPLES_PER_SHARD} per shard")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as raw:
            writer = _HashingWriter(raw)
            with tarfile.open(fileobj=writer, mode="w", format=tarfile.USTAR_FORMAT) as tar:
                for i, sample in enumerate(samples):
                    key = sample_key(shard_index, i)
                    parts = [
                        (ext, _npy_bytes(getattr(sample, attr), dtype))
                        for ext, attr, dtype in _FIELDS
                    ]
                    parts.append(("json", _json_bytes(sample)))
                    for ext, data in parts:
                        tar.addfile(_member(f"{key}.{ext}", len(data)), io.BytesIO(data))
            raw.flush()
            os.fsync(raw.fileno())
        os.chmod(tmp, 0o644 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)
    return writer.digest.hexdigest()


def read_shard(path: Path) -> list[PackedSample]:
    """Read a shard written by :func:`write_shard` back into samples, without webdataset.

    For resume checks and tests; training reads shards through webdataset or Energon.
    """
    grouped: dict[str, dict[str, bytes]] = {}
    with tarfile.open(path, mode="r:") as tar:
        for member in tar:
            if not member.isfile():
                continue
            key, _, ext = member.name.partition(".")
            handle = tar.extractfile(member)
            assert handle is not None
            grouped.setdefault(key, {})[ext] = handle.read()
    samples = []
    for parts in grouped.values():
        arrays = {
            attr: np.load(io.BytesIO(parts[ext]), allow_pickle=False) for ext, attr, _ in _FIELDS
        }
        doc_keys = list(json.loads(parts["json"].decode("utf-8"))["doc_keys"])
        samples.append(PackedSample(doc_keys=doc_keys, **arrays))
    return samples
