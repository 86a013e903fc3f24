"""One packed sample (:class:`PackedSample`) and how a shard stores it: members, dtypes, bytes.

The one field table of the shard format (:data:`SHARD_FIELDS`): the writer
(``tar_writer``), the reader (``shard_reader``) and the Energon cooker
(``energon_task_encoder``) all take member names and dtypes from it. Sample
``i`` of shard ``s`` has the key ``f"{s:06d}{i:06d}"`` (webdataset groups members
by the part of the name before the first dot, so keys contain none) and these
members, in this order:

* ``{key}.tokens.npy``: int32 [seq_len] (``np.save`` bytes, little-endian, no pickle)
* ``{key}.loss_mask.npy``: uint8 [seq_len]
* ``{key}.cu_seqlens.npy``: int32 [n_docs + 1]
* ``{key}.json``: ``{"doc_keys": [...]}``, sorted keys, compact separators

``.npy`` headers are cached per dtype and shape, both ways: every sample of a
build has the same ``seq_len``, and ``np.save`` and numpy's header parser (which
uses ``ast``) were most of the per-member cost of writing and reading.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple

import numpy as np

__all__ = [
    "ARRAY_FIELDS",
    "CU_SEQLENS",
    "DOC_KEYS",
    "LOSS_MASK",
    "MAX_SAMPLES_PER_SHARD",
    "SHARD_FIELDS",
    "TOKENS",
    "PackedSample",
    "ShardField",
    "json_bytes",
    "npy_bytes",
    "npy_view",
    "sample_key",
    "sample_members",
]

MAX_SAMPLES_PER_SHARD = 1_000_000
"""The sample index takes six digits of the key."""


@dataclass(frozen=True, eq=False)
class PackedSample:
    """One packed training sequence.

    ``tokens`` [seq_len] int32, padded at the end with ``pad_id``;
    ``loss_mask`` [seq_len] uint8, the documents' masks side by side and 0 on
    padding; ``cu_seqlens`` [n_docs + 1] int32, cumulative document lengths
    starting at 0, so document ``d`` spans ``cu_seqlens[d]:cu_seqlens[d + 1]``
    and ``cu_seqlens[-1]`` is the number of real tokens (padding lies beyond
    it). Varlen attention uses these boundaries so packed documents never
    attend to each other. ``doc_keys`` name the documents in the same order.
    """

    tokens: np.ndarray
    loss_mask: np.ndarray
    cu_seqlens: np.ndarray
    doc_keys: list[str]

    @property
    def seq_len(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def n_docs(self) -> int:
        return len(self.doc_keys)

    @property
    def n_tokens(self) -> int:
        """Real (non-pad) tokens."""
        return int(self.cu_seqlens[-1])


class ShardField(NamedTuple):
    """One member of a stored sample: its name after the key, the :class:`PackedSample`
    attribute it holds, and its dtype (None: the JSON member)."""

    suffix: str
    attr: str
    dtype: np.dtype | None


TOKENS = ShardField("tokens.npy", "tokens", np.dtype("<i4"))
LOSS_MASK = ShardField("loss_mask.npy", "loss_mask", np.dtype("u1"))
CU_SEQLENS = ShardField("cu_seqlens.npy", "cu_seqlens", np.dtype("<i4"))
DOC_KEYS = ShardField("json", "doc_keys", None)
ARRAY_FIELDS: tuple[ShardField, ...] = (TOKENS, LOSS_MASK, CU_SEQLENS)
"""The ``.npy`` members, which are what training reads."""
SHARD_FIELDS: tuple[ShardField, ...] = (*ARRAY_FIELDS, DOC_KEYS)
"""Every member of a sample, in the order the writer stores them."""


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


def npy_bytes(array: np.ndarray, dtype: np.dtype) -> bytes:
    """``.npy`` bytes of ``array`` in a fixed dtype and C order (what ``np.save`` writes)."""
    array = np.ascontiguousarray(array, dtype=dtype)
    return _npy_header(array.dtype.str, array.shape) + array.tobytes()


def json_bytes(sample: PackedSample) -> bytes:
    """The JSON member of ``sample``: its documents' keys."""
    text = json.dumps({"doc_keys": list(sample.doc_keys)}, sort_keys=True, separators=(",", ":"))
    return text.encode("utf-8")


def sample_members(sample: PackedSample, key: str) -> list[tuple[str, bytes]]:
    """``(member name, bytes)`` of every field of ``sample``, in :data:`SHARD_FIELDS` order."""
    return [
        (
            f"{key}.{field.suffix}",
            json_bytes(sample)
            if field.dtype is None
            else npy_bytes(getattr(sample, field.attr), field.dtype),
        )
        for field in SHARD_FIELDS
    ]


@lru_cache(maxsize=1024)
def _parsed_npy_header(prefix: bytes) -> tuple[tuple[int, ...], np.dtype]:
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


def npy_view(data: bytes, start: int, size: int, expected: np.dtype) -> np.ndarray:
    """Zero-copy view of the ``.npy`` member at ``data[start:start + size]`` (``ValueError`` or
    ``IndexError`` when it is not a 1-D array of ``expected`` that fits its member)."""
    width = 2 if data[start + 6] == 1 else 4  # header-length field of format 1.0 vs 2.0/3.0
    body = start + 8 + width + int.from_bytes(data[start + 8 : start + 8 + width], "little")
    shape, dtype = _parsed_npy_header(data[start:body])
    if dtype != expected:
        raise ValueError(f"dtype {dtype}, expected {expected}")
    if body + shape[0] * dtype.itemsize > start + size:
        raise ValueError("array runs past its member")
    return np.frombuffer(data, dtype=dtype, count=shape[0], offset=body)
