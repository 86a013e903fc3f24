"""Training micro-batches from built shards: the folder and its reader.

The pieces every reader of a built folder shares live here: :class:`MicroBatch`
(what the training loop consumes), :func:`list_shards` (the manifest, checked
against the files before anything is decoded; failures are :class:`DataError`),
:func:`read_shard_samples` (one shard's samples as zero-copy numpy views) and
:func:`collate`. :class:`factory.runtime.loader.ShardLoader` streams them in a
resumable order; :func:`read_samples` reads a small folder whole (tests and
reports that need every sample at once).

:func:`build_shards` runs the data pipeline on a blueprint's recipe at the
blueprint's ``data.seq_len`` (a recipe packs at its own ``packing.seq_len``,
4096 for the shipped ones; a proxy trains at 256), so a proxy trains on the
real curated mixture.
"""

from __future__ import annotations

import io
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path, PurePosixPath
from typing import Any, NamedTuple

import numpy as np
import torch

from factory.data.shards import manifest as manifest_io
from factory.nn.packed_documents import document_ids_from_cu_seqlens
from factory.schemas.blueprint import Blueprint

__all__ = [
    "DataError",
    "MicroBatch",
    "Sample",
    "ShardInfo",
    "build_shards",
    "collate",
    "list_shards",
    "read_samples",
    "read_shard_samples",
]


class DataError(ValueError):
    """A built data folder is missing, incomplete or corrupt; the message names what and where."""


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch of packed sequences.

    ``input_ids`` [B, S] int64; ``loss_mask`` [B, S] bool with the packing
    convention: ``loss_mask[b, i]`` says token ``i`` is a training target, i.e.
    the prediction made at position ``i - 1`` counts (prompts and padding are
    0). :func:`factory.graph.loss.language_model_loss` takes both as they are
    and does the shift, also for the MTP depths. ``document_ids`` [B, S] int64
    (None where the source has no ``cu_seqlens``) is the packed document of
    every position, as the graph's mixers take it (``factory/nn/packed_documents.py``).
    """

    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    document_ids: torch.Tensor | None = None

    @property
    def targets(self) -> torch.Tensor:
        """[B, S-1]: the tokens the main head predicts at positions 0..S-2."""
        return self.input_ids[:, 1:]

    @property
    def target_mask(self) -> torch.Tensor:
        """[B, S-1]: which of :attr:`targets` count in the loss."""
        return self.loss_mask[:, 1:]

    @property
    def num_tokens(self) -> int:
        """Positions in the batch (padding included), what tokens-seen counts."""
        return int(self.input_ids.numel())


class Sample(NamedTuple):
    """One packed sample as stored: tokens int32 [S], loss_mask uint8 [S], cu_seqlens int32."""

    tokens: np.ndarray
    loss_mask: np.ndarray
    cu_seqlens: np.ndarray


def collate(samples: Sequence[Sample]) -> MicroBatch:
    """Stack samples of one length into a :class:`MicroBatch` (copies: no view outlives it).

    Positions past a sample's last ``cu_seqlens`` entry (padding) are a
    document of their own, as :func:`document_ids_from_cu_seqlens` defines.
    """
    tokens = np.stack([s.tokens for s in samples]).astype(np.int64)
    mask = np.stack([s.loss_mask for s in samples]).astype(bool)
    # astype copies: torch warns on (and must never write through) read-only shard views
    bounds = [s.cu_seqlens.astype(np.int64) for s in samples]
    documents = document_ids_from_cu_seqlens(bounds, tokens.shape[1])
    return MicroBatch(torch.from_numpy(tokens), torch.from_numpy(mask), documents)


@dataclass(frozen=True)
class ShardInfo:
    """One ``manifest["shards"]`` entry, resolved: ``name`` as listed, ``path`` on disk."""

    name: str
    path: Path
    samples: int
    sha256: str


_BLOCK = 512
_END = bytes(2 * _BLOCK)
_MIN_SAMPLE_BYTES = 8 * _BLOCK
"""Four members per sample, each a header block and at least one data block."""


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
    if size % _BLOCK or size < least:
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


@lru_cache(maxsize=1024)
def _npy_header(prefix: bytes) -> tuple[tuple[int, ...], np.dtype]:
    """(shape, dtype) of an ``.npy`` header; cached because numpy parses it with ``ast``.

    A shard repeats a handful of distinct headers (one per ``cu_seqlens``
    length), and parsing each one anew was half of the decode time.
    """
    handle = io.BytesIO(prefix)
    if np.lib.format.read_magic(handle) == (1, 0):
        shape, fortran, dtype = np.lib.format.read_array_header_1_0(handle)
    else:
        shape, fortran, dtype = np.lib.format.read_array_header_2_0(handle)
    if fortran or len(shape) != 1:
        raise ValueError(f"expected a 1-D C-order array, got shape {shape} fortran={fortran}")
    return shape, dtype


def _npy(data: bytes, start: int, size: int, expected: np.dtype) -> np.ndarray:
    """Zero-copy view of the ``.npy`` member at ``data[start:start + size]``."""
    width = 2 if data[start + 6] == 1 else 4  # header-length field of format 1.0 vs 2.0/3.0
    body = start + 8 + width + int.from_bytes(data[start + 8 : start + 8 + width], "little")
    shape, dtype = _npy_header(data[start:body])
    if dtype != expected:
        raise ValueError(f"dtype {dtype}, expected {expected}")
    if body + shape[0] * dtype.itemsize > start + size:
        raise ValueError("array runs past its member")
    return np.frombuffer(data, dtype=dtype, count=shape[0], offset=body)


_FIELDS = {
    "tokens.npy": np.dtype("<i4"),
    "loss_mask.npy": np.dtype("u1"),
    "cu_seqlens.npy": np.dtype("<i4"),
}


def _octal(field: bytes, where: str, offset: int) -> int:
    try:
        return int(field.rstrip(b"\0 ") or b"0", 8)
    except ValueError:
        raise DataError(f"{where}: damaged tar header at byte {offset}") from None


def _members(data: bytes, where: str) -> Iterator[tuple[str, int, int]]:
    """(name, data offset, size) of each regular file of a USTAR archive, in order."""
    offset = 0
    while data[offset : offset + 2 * _BLOCK] != _END:
        header = data[offset : offset + _BLOCK]
        if len(header) < _BLOCK:
            raise DataError(f"{where}: truncated at byte {offset} (no end-of-archive marker)")
        # The checksum sums the header with its own field read as spaces (POSIX ustar).
        if _octal(header[148:156], where, offset) != sum(header) - sum(header[148:156]) + 256:
            raise DataError(f"{where}: bad tar header checksum at byte {offset}")
        size = _octal(header[124:136], where, offset)
        start, offset = offset + _BLOCK, offset + _BLOCK + -(-size // _BLOCK) * _BLOCK
        if start + size > len(data):
            raise DataError(f"{where}: truncated inside member at byte {start}")
        if header[156:157] in (b"0", b"\0"):  # regular files; our writer makes nothing else
            yield header[:100].rstrip(b"\0").decode("utf-8", "replace"), start, size


def read_shard_samples(shard: ShardInfo) -> list[Sample]:
    """Every sample of one shard, in stored order, as views into one read of the file.

    Our own walk over the USTAR headers rather than webdataset or ``tarfile``:
    about 13x faster on our shards (``factory/runtime/loader.py`` has the numbers).
    Raises :class:`DataError` if the tar is damaged or its sample count is not
    the manifest's.
    """
    where = f"{shard.path} (shard {shard.name})"
    data = shard.path.read_bytes()
    grouped: dict[str, dict[str, np.ndarray]] = {}
    for name, start, size in _members(data, where):
        key, _, ext = name.partition(".")
        if ext in _FIELDS:
            try:
                grouped.setdefault(key, {})[ext] = _npy(data, start, size, _FIELDS[ext])
            except (ValueError, IndexError) as exc:
                raise DataError(f"{where}: member {name}: {exc}") from exc
    samples = []
    for key, fields in grouped.items():
        if len(fields) != len(_FIELDS):
            raise DataError(f"{where}: sample {key} lacks {sorted(set(_FIELDS) - set(fields))}")
        sample = Sample(fields["tokens.npy"], fields["loss_mask.npy"], fields["cu_seqlens.npy"])
        if sample.loss_mask.shape != sample.tokens.shape:
            raise DataError(f"{where}: sample {key}: loss_mask and tokens differ in length")
        samples.append(sample)
    if len(samples) != shard.samples:
        raise DataError(f"{where}: {len(samples)} samples, the manifest lists {shard.samples}")
    return samples


def build_shards(blueprint: Blueprint, out: Path, workers: int = 1) -> Path:
    """Build ``blueprint.data.recipe`` into ``out`` packed at ``blueprint.data.seq_len``.

    Returns ``out``. The pipeline is resumable and deterministic, so calling
    this again on the same folder reuses the curated intermediates.
    """
    from factory.data.build_job import build

    build(blueprint.data.recipe, out, workers=workers, seq_len=blueprint.data.seq_len)
    return out


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
