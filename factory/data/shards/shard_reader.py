"""Reading a built folder's shards: the manifest's list, checked, and each shard's samples.

:func:`list_shards` resolves ``manifest["shards"]`` and checks every file
before anything is decoded; :func:`read_shard_samples` gives one shard's samples
as zero-copy numpy views into one read of the file, through the one tar reader
(``tar_reader``) and the field table (``sample_format``); :func:`read_samples`
reads a small folder whole (tests and reports that need every sample at once).
``factory.runtime.loader.ShardLoader`` streams them for training. Every problem
is a :class:`DataError` naming the folder or shard and what is wrong.
"""

from __future__ import annotations

import tarfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, NamedTuple

import numpy as np

from factory.data.shards import manifest as manifest_io
from factory.data.shards.sample_format import ARRAY_FIELDS, SHARD_FIELDS, npy_view
from factory.data.shards.tar_reader import BLOCK, DamagedTar, tar_listing

__all__ = [
    "DataError",
    "Sample",
    "ShardInfo",
    "list_shards",
    "read_samples",
    "read_shard_samples",
]


class DataError(ValueError):
    """A built data folder is missing, incomplete or corrupt; the message names what and where."""


class Sample(NamedTuple):
    """One packed sample as stored: tokens int32 [S], loss_mask uint8 [S], cu_seqlens int32."""

    tokens: np.ndarray
    loss_mask: np.ndarray
    cu_seqlens: np.ndarray


@dataclass(frozen=True)
class ShardInfo:
    """One ``manifest["shards"]`` entry, resolved: ``name`` as listed, ``path`` on disk."""

    name: str
    path: Path
    samples: int
    sha256: str


_END = bytes(2 * BLOCK)
_MIN_SAMPLE_BYTES = 2 * BLOCK * len(SHARD_FIELDS)
"""Every member of a sample has a header block and at least one data block."""
_ARRAYS = {field.suffix: field for field in ARRAY_FIELDS}


def _manifest_entries(directory: Path) -> list[Any]:
    path = directory / manifest_io.MANIFEST_NAME
    if not path.is_file():
        raise DataError(f"{directory}: no {manifest_io.MANIFEST_NAME} (not a finished data build)")
    try:
        shards = manifest_io.read_manifest(directory).get("shards")
    except ValueError as exc:  # JSONDecodeError is a ValueError
        raise DataError(f"{path}: not a readable manifest: {exc}") from exc
    if not isinstance(shards, list):
        raise DataError(f"{path}: 'shards' must be a list")
    return shards


def _shard_info(directory: Path, position: int, entry: Any) -> ShardInfo:
    where = f"{directory / manifest_io.MANIFEST_NAME}: shards[{position}]"
    if not isinstance(entry, dict):
        raise DataError(f"{where}: not an object")
    name, samples, sha = entry.get("name"), entry.get("samples"), entry.get("sha256", "")
    pure = PurePosixPath(name) if isinstance(name, str) else None
    if pure is None or not name or pure.is_absolute() or ".." in pure.parts:
        raise DataError(f"{where}: name {name!r} is not a path inside the folder")
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 0:
        raise DataError(f"{where} ({name}): samples {samples!r} is not a count")
    return ShardInfo(name, directory.joinpath(*pure.parts), samples, str(sha))


def _check_file(shard: ShardInfo) -> None:
    """Cheap structural checks that catch a missing, truncated or half-copied tar.

    The manifest records no byte size, so the size is checked against what a
    tar of ``samples`` samples must have: whole 512-byte blocks, at least eight
    per sample, and the two zero blocks that end every archive.
    """
    if not shard.path.is_file():
        raise DataError(f"{shard.path}: shard {shard.name} listed in the manifest is missing")
    size = shard.path.stat().st_size
    least = shard.samples * _MIN_SAMPLE_BYTES + len(_END)
    if size % BLOCK or size < least:
        raise DataError(
            f"{shard.path}: {size} bytes is not a whole tar of {shard.samples} samples "
            f"(at least {least} bytes in 512-byte blocks); truncated?"
        )
    with open(shard.path, "rb") as handle:
        handle.seek(size - len(_END))
        if handle.read() != _END:
            raise DataError(f"{shard.path}: no end-of-archive marker; truncated?")


def list_shards(directory: Path, verify: bool = False) -> list[ShardInfo]:
    """The manifest's shards in order, each checked to exist as a plausible, whole tar.

    ``verify`` also re-hashes every shard against the manifest's sha256
    (:func:`factory.data.shards.manifest.verify`): a full read of the dataset.
    Raises :class:`DataError` naming the folder or shard and what is wrong.
    """
    directory = Path(directory)
    shards = [_shard_info(directory, i, e) for i, e in enumerate(_manifest_entries(directory))]
    for shard in shards:
        _check_file(shard)
    if verify and (bad := manifest_io.verify(directory)):
        raise DataError(f"{directory}: shards differ from the manifest's sha256: {', '.join(bad)}")
    return shards


def read_shard_samples(shard: ShardInfo) -> list[Sample]:
    """Every sample of one shard, in stored order, as views into one read of the file.

    The tar reader walks the USTAR headers (checksums and bounds checked) rather
    than webdataset or ``tarfile``, and each distinct ``.npy`` header is parsed
    once: about 13x faster on our shards (``factory/runtime/loader.py`` has the
    numbers). Raises :class:`DataError` if the tar is damaged or its sample count
    is not the manifest's.
    """
    where = f"{shard.path} (shard {shard.name})"
    data = shard.path.read_bytes()
    try:
        members = tar_listing(data).members
    except (DamagedTar, tarfile.TarError) as exc:
        raise DataError(f"{where}: {exc}") from exc
    grouped: dict[str, dict[str, np.ndarray]] = {}
    for member in members:
        key, _, suffix = member.name.partition(".")
        field = _ARRAYS.get(suffix)
        if field is not None:
            try:
                array = npy_view(data, member.offset_data, member.size, field.dtype)  # type: ignore[arg-type]
            except (ValueError, IndexError) as exc:
                raise DataError(f"{where}: member {member.name}: {exc}") from exc
            grouped.setdefault(key, {})[field.attr] = array
    samples = []
    for key, fields in grouped.items():
        if len(fields) != len(ARRAY_FIELDS):
            missing = sorted(f.suffix for f in ARRAY_FIELDS if f.attr not in fields)
            raise DataError(f"{where}: sample {key} lacks {missing}")
        sample = Sample(**fields)
        if sample.loss_mask.shape != sample.tokens.shape:
            raise DataError(f"{where}: sample {key}: loss_mask and tokens differ in length")
        samples.append(sample)
    if len(samples) != shard.samples:
        raise DataError(f"{where}: {len(samples)} samples, the manifest lists {shard.samples}")
    return samples


def read_samples(directory: Path) -> tuple[np.ndarray, np.ndarray]:
    """All samples of a built folder as (tokens int64 [N, S], loss_mask bool [N, S]).

    Shards are read in the manifest's order, samples in shard order: the same
    folder always gives the same arrays. Raises :class:`DataError` on a folder
    without a manifest (an unfinished build), a damaged shard or no samples.
    """
    samples = [s for shard in list_shards(directory) for s in read_shard_samples(shard)]
    if not samples:
        raise DataError(f"{directory}: no samples")
    if len({s.tokens.shape for s in samples}) > 1:
        raise DataError(f"{directory}: samples differ in length")
    tokens = np.stack([s.tokens for s in samples]).astype(np.int64)
    mask = np.stack([s.loss_mask for s in samples]).astype(bool)
    return tokens, mask
