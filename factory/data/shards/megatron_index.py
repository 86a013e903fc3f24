"""Megatron's indexed dataset (``prefix.bin`` + ``prefix.idx``): the pretraining sink.

Megatron-LM's ``GPTDataset`` reads unpacked documents from these two files and
does its own sampling and packing, so pretraining data goes here rather than
into packed shards. Written from the published layout, without Megatron:

``.bin``: every document's token ids back to back, in the index dtype.

``.idx`` (all little-endian):

* magic ``b"MMIDIDX\\x00\\x00"``, version ``<Q`` = 1, dtype code ``<B``
  (uint16 = 8, int32 = 4)
* ``<Q`` sequence count ``S``, ``<Q`` document-index count ``D``
* int32[S] sequence lengths, int64[S] byte offsets of each sequence in ``.bin``
* int64[D] document indices: sequence boundaries of documents, starting at 0

Here every document is one sequence, so the document indices are
``0, 1, ..., S``. Note that ``D`` is the number of *entries* (documents + 1),
not the number of documents: that is what Megatron writes and what its reader
expects to read back.

dtype: uint16 when the vocabulary fits (``vocab_size < 65500``, Megatron's
rule), else int32. The ``.bin`` is written to a temporary file and renamed on
:meth:`IndexedDatasetWriter.finalize`; the ``.idx`` is renamed in last, so a
present ``.idx`` means a complete pair.
"""

from __future__ import annotations

import os
import struct
import tempfile
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

import numpy as np

__all__ = ["DTYPE_CODES", "MAGIC", "IndexedDatasetWriter", "read_indexed"]

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
DTYPE_CODES: dict[int, np.dtype] = {8: np.dtype("<u2"), 4: np.dtype("<i4")}
_CODE_OF = {dtype: code for code, dtype in DTYPE_CODES.items()}


def _dtype_for(vocab_size: int | None) -> np.dtype:
    """uint16 halves the file for vocabularies that fit; unknown vocabularies get int32."""
    if vocab_size is not None and vocab_size < 65500:
        return np.dtype("<u2")
    return np.dtype("<i4")


def _tmp_beside(path: Path) -> Path:
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    return Path(name)


class IndexedDatasetWriter:
    """Append documents with :meth:`add_document`, then :meth:`finalize` (or use ``with``)."""

    def __init__(self, prefix: Path | str, vocab_size: int | None = None) -> None:
        self.prefix = Path(prefix)
        self.prefix.parent.mkdir(parents=True, exist_ok=True)
        self.dtype = _dtype_for(vocab_size)
        self.vocab_size = vocab_size
        self._lengths: list[int] = []
        self._bin_path = Path(f"{self.prefix}.bin")
        self._idx_path = Path(f"{self.prefix}.idx")
        self._bin_tmp = _tmp_beside(self._bin_path)
        self._bin = open(self._bin_tmp, "wb")  # noqa: SIM115 - closed in finalize/abort
        self._done = False

    def add_document(self, ids: np.ndarray | Sequence[int]) -> None:
        """Append one document (one sequence); ids must fit the index dtype and vocabulary."""
        if self._done:
            raise RuntimeError("writer already finalized")
        array = np.asarray(ids)
        if array.ndim != 1:
            raise ValueError(f"a document is a 1-D array of ids, got shape {array.shape}")
        if array.size:
            if array.dtype.kind not in "iu":
                raise TypeError(f"token ids must be integers, got {array.dtype}")
            limit = self.vocab_size if self.vocab_size is not None else np.iinfo(self.dtype).max + 1
            low, high = int(array.min()), int(array.max())
            if low < 0 or high >= limit:
                raise ValueError(f"token ids must be in [0, {limit}), got [{low}, {high}]")
        self._bin.write(np.ascontiguousarray(array, dtype=self.dtype).tobytes())
        self._lengths.append(int(array.size))

    def _index_bytes(self) -> bytes:
        lengths = np.asarray(self._lengths, dtype=np.int64)
        pointers = np.zeros(len(lengths), dtype=np.int64)
        if len(lengths) > 1:
            np.cumsum(lengths[:-1] * self.dtype.itemsize, out=pointers[1:])
        doc_indices = np.arange(len(lengths) + 1, dtype=np.int64)
        header = MAGIC + struct.pack("<Q", VERSION) + struct.pack("<B", _CODE_OF[self.dtype])
        counts = struct.pack("<Q", len(lengths)) + struct.pack("<Q", len(doc_indices))
        return b"".join(
            [
                header,
                counts,
                lengths.astype("<i4").tobytes(),
                pointers.astype("<i8").tobytes(),
                doc_indices.astype("<i8").tobytes(),
            ]
        )

    def finalize(self) -> None:
        """Flush and publish ``.bin`` then ``.idx``; idempotent."""
        if self._done:
            return
        self._bin.flush()
        os.fsync(self._bin.fileno())
        self._bin.close()
        idx_tmp = _tmp_beside(self._idx_path)
        try:
            with open(idx_tmp, "wb") as handle:
                handle.write(self._index_bytes())
                handle.flush()
                os.fsync(handle.fileno())
            for tmp in (self._bin_tmp, idx_tmp):
                os.chmod(tmp, 0o644)
            os.replace(self._bin_tmp, self._bin_path)
            os.replace(idx_tmp, self._idx_path)
        except BaseException:
            idx_tmp.unlink(missing_ok=True)
            self.abort()
            raise
        self._done = True

    def abort(self) -> None:
        """Drop what was written; the final paths are left as they were."""
        self._bin.close()
        self._bin_tmp.unlink(missing_ok=True)
        self._done = True

    def __enter__(self) -> IndexedDatasetWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            self.finalize()
        else:
            self.abort()


def read_indexed(prefix: Path | str) -> list[np.ndarray]:
    """Read every sequence back (a check of the writer, not a training reader)."""
    idx = Path(f"{prefix}.idx").read_bytes()
    if idx[: len(MAGIC)] != MAGIC:
        raise ValueError(f"{prefix}.idx: bad magic {idx[: len(MAGIC)]!r}")
    offset = len(MAGIC)
    (version,) = struct.unpack_from("<Q", idx, offset)
    (code,) = struct.unpack_from("<B", idx, offset + 8)
    n_seq, n_doc_idx = struct.unpack_from("<QQ", idx, offset + 9)
    if version != VERSION or code not in DTYPE_CODES:
        raise ValueError(f"{prefix}.idx: unsupported version {version} or dtype code {code}")
    offset += 9 + 16
    lengths = np.frombuffer(idx, dtype="<i4", count=n_seq, offset=offset)
    offset += 4 * n_seq
    pointers = np.frombuffer(idx, dtype="<i8", count=n_seq, offset=offset)
    offset += 8 * n_seq
    doc_indices = np.frombuffer(idx, dtype="<i8", count=n_doc_idx, offset=offset)
    if n_doc_idx == 0 or doc_indices[0] != 0 or doc_indices[-1] != n_seq:
        raise ValueError(f"{prefix}.idx: document indices do not cover the sequences")
    dtype = DTYPE_CODES[code]
    data = np.fromfile(f"{prefix}.bin", dtype=dtype)
    return [
        data[p // dtype.itemsize : p // dtype.itemsize + n].copy()
        for p, n in zip(pointers.tolist(), lengths.tolist(), strict=True)
    ]
