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

Speed: the bytes are the ones ``tarfile`` (USTAR) and ``np.save`` write, but
built directly: a fixed header template with the name, size and checksum
filled in, and ``.npy`` headers cached per dtype and shape (every sample of a
build has the same ``seq_len``). ``tarfile`` and ``np.save`` took most of this
stage's time in per-member Python overhead; tests compare both ways byte for
byte.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import tarfile
import tempfile
from functools import lru_cache
from pathlib import Path

import numpy as np

from factory.data.stages.packing import PackedSample

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


@lru_cache(maxsize=64)
def _npy_header(descr: str, shape: tuple[int, ...]) -> bytes:
    """The ``np.save`` header of a C-order array: taken from ``np.save`` itself, once."""
    dtype = np.dtype(descr)
    buffer = io.BytesIO()
    np.save(buffer, np.zeros(shape, dtype=dtype), allow_pickle=False)
    data = buffer.getvalue()
    return data[: len(data) - dtype.itemsize * int(np.prod(shape, dtype=np.int64))]


def _npy_bytes(array: np.ndarray, dtype: np.dtype) -> bytes:
    """``.npy`` bytes of ``array`` in a fixed dtype and C order (what ``np.save`` writes)."""
    array = np.ascontiguousarray(array, dtype=dtype)
    return _npy_header(array.dtype.str, array.shape) + array.tobytes()


def _json_bytes(sample: PackedSample) -> bytes:
    text = json.dumps({"doc_keys": list(sample.doc_keys)}, sort_keys=True, separators=(",", ":"))
    return text.encode("utf-8")


_BLOCK = tarfile.BLOCKSIZE
_RECORD = tarfile.RECORDSIZE


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


# tarfile's own header for an empty name and size 0: every other field is the same for
# every member, so a member's header is this with its name, size and checksum put in.
_TEMPLATE = _member("", 0).tobuf(tarfile.USTAR_FORMAT, "utf-8", "surrogateescape")
_AFTER_NAME = _TEMPLATE[100:124]  # mode, uid, gid
_AFTER_SIZE = _TEMPLATE[136:148] + b" " * 8 + _TEMPLATE[156:]  # mtime, checksum as spaces, rest


def _header(name: str, size: int) -> bytes:
    """The 512-byte USTAR header ``tarfile`` writes for ``_member(name, size)``."""
    raw = name.encode("utf-8")
    if len(raw) > 100 or size >= 8**11:
        raise ValueError(f"member {name!r} of {size} bytes does not fit a plain USTAR header")
    head = raw.ljust(100, b"\x00") + _AFTER_NAME + b"%011o\x00" % size + _AFTER_SIZE
    # The checksum is the byte sum with its own field as spaces, written "%06o\0 " as tarfile.
    return head[:148] + b"%06o\x00" % sum(head) + head[155:]


def _tar_bytes(members: list[tuple[str, bytes]]) -> list[bytes]:
    """The chunks of a whole USTAR archive of ``members`` (as ``tarfile`` closes one)."""
    chunks, offset = [], 0
    for name, data in members:
        pad = -len(data) % _BLOCK
        chunks += [_header(name, len(data)), data, b"\x00" * pad]
        offset += _BLOCK + len(data) + pad
    offset += 2 * _BLOCK  # two zero blocks end the archive; zeros fill its last record
    chunks.append(b"\x00" * (2 * _BLOCK + -offset % _RECORD))
    return chunks


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
    members = []
    for i, sample in enumerate(samples):
        key = sample_key(shard_index, i)
        for ext, attr, dtype in _FIELDS:
            members.append((f"{key}.{ext}", _npy_bytes(getattr(sample, attr), dtype)))
        members.append((f"{key}.json", _json_bytes(sample)))
    data = b"".join(_tar_bytes(members))  # one shard is a few MB: hashed and written at once
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as raw:
            raw.write(data)
            raw.flush()
            os.fsync(raw.fileno())
        os.chmod(tmp, 0o644 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)
    return hashlib.sha256(data).hexdigest()


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
