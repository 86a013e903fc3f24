"""Deterministic webdataset shards: identical samples always give byte-identical tar files.

Why byte-identical: the manifest records each shard's sha256, so a rebuild can
prove it reproduced a shard, ``verify`` can catch corruption, and a resumed
build can skip shards whose hash already matches. Everything that tar would
otherwise take from the environment (time, owner, umask, member order) is
fixed here. The members of each sample, their order and bytes, are
``sample_format``'s; the one reader of what this writes is ``tar_reader``.

The file is written to a temporary sibling, fsynced and renamed into place, so
a reader (or a crash) never sees half a shard under the final name.

Speed: the bytes are the ones ``tarfile`` (USTAR) and ``np.save`` write, but
built directly: a fixed header template with the name, size and checksum
filled in, and ``.npy`` headers cached per dtype and shape. ``tarfile`` and
``np.save`` took most of this stage's time in per-member Python overhead; tests
compare both ways byte for byte.
"""

from __future__ import annotations

import hashlib
import os
import tarfile
import tempfile
from pathlib import Path

from factory.data.shards.sample_format import (
    MAX_SAMPLES_PER_SHARD,
    PackedSample,
    sample_key,
    sample_members,
)
from factory.data.shards.tar_reader import BLOCK
from factory.io import naming

__all__ = ["write_shard"]

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
        pad = -len(data) % BLOCK
        chunks += [_header(name, len(data)), data, b"\x00" * pad]
        offset += BLOCK + len(data) + pad
    offset += 2 * BLOCK  # two zero blocks end the archive; zeros fill its last record
    chunks.append(b"\x00" * (2 * BLOCK + -offset % _RECORD))
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
    if anything fails the temporary file is removed and ``path`` is untouched
    (a full disk raises ``OSError(ENOSPC)`` naming ``path``).
    """
    path = Path(path)
    if len(samples) > MAX_SAMPLES_PER_SHARD:
        raise ValueError(f"{len(samples)} samples exceed {MAX_SAMPLES_PER_SHARD} per shard")
    members = [
        member
        for i, sample in enumerate(samples)
        for member in sample_members(sample, sample_key(shard_index, i))
    ]
    data = b"".join(_tar_bytes(members))  # one shard is a few MB: hashed and written at once
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    tmp = Path(tmp_name)
    try:
        with naming(path), os.fdopen(fd, "wb") as raw:
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
