"""Best-fit-decreasing sequence packing of tokenized documents into fixed-length samples.

Why best-fit decreasing over a bounded window: sorting a window of documents by
length and placing each into the fullest bin that still fits wastes far less
padding than greedy concatenation, while the window keeps memory bounded
(at most ``window * seq_len`` tokens are buffered) so packing streams over
corpora of any size. Every step is a pure function of the input order and the
keys, so the same documents always give byte-identical samples: the shards
built from them can be hashed, verified and resumed.

Documents are never truncated: one longer than ``seq_len`` is cut into
``seq_len``-sized pieces that are packed as separate documents (and counted).
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from typing import Protocol, Self, TypeVar

import numpy as np

from factory.data.shards.sample_format import PackedSample

__all__ = [
    "PIECE_SEPARATOR",
    "Packable",
    "PackingStats",
    "TokenizedDoc",
    "pack_best_fit_decreasing",
    "pack_bins",
    "packed_sample",
    "packing_stats",
]

PIECE_SEPARATOR = "#"
"""A piece of a split document is keyed ``f"{key}{PIECE_SEPARATOR}{j}"`` (j from 0)."""


@dataclass(frozen=True, eq=False)
class TokenizedDoc:
    """One tokenized document on its way into packing.

    ``ids`` are token ids (int32). ``mask`` is aligned with ``ids``:
    ``mask[i] == 1`` means token ``ids[i]`` is a training target, i.e. the loss
    term that predicts ``ids[i]`` (computed at position ``i - 1`` after the
    usual next-token shift) counts; ``0`` means it is context only (system,
    user and tool turns). Packing never changes this meaning; it only moves
    whole spans. Arrays are coerced to contiguous int32 / uint8 on creation.
    """

    key: str
    ids: np.ndarray
    mask: np.ndarray

    def __post_init__(self) -> None:
        ids = np.ascontiguousarray(self.ids, dtype=np.int32)
        mask = np.ascontiguousarray(self.mask, dtype=np.uint8)
        if ids.ndim != 1 or mask.shape != ids.shape:
            raise ValueError(
                f"doc {self.key!r}: ids and mask must be 1-D and aligned, "
                f"got shapes {ids.shape} and {mask.shape}"
            )
        if mask.size and int(mask.max()) > 1:
            raise ValueError(f"doc {self.key!r}: mask values must be 0 or 1")
        object.__setattr__(self, "ids", ids)
        object.__setattr__(self, "mask", mask)

    def __len__(self) -> int:
        return int(self.ids.shape[0])

    def piece(self, index: int, start: int, end: int) -> TokenizedDoc:
        """Tokens ``start:end`` as piece ``index`` (keyed ``key#index``)."""
        return TokenizedDoc(
            f"{self.key}{PIECE_SEPARATOR}{index}", self.ids[start:end], self.mask[start:end]
        )


@dataclass
class PackingStats:
    """Running counters of a packing pass; pass one to the packer to fill it.

    Split counts are only known to the packer (samples carry pieces, not the
    documents they came from), hence a mutable accumulator rather than a
    function of the output alone.
    """

    seq_len: int = 0
    samples: int = 0
    documents: int = 0
    segments: int = 0
    tokens: int = 0
    loss_tokens: int = 0
    split_documents: int = 0
    split_pieces: int = 0
    empty_documents: int = 0

    def add_sample(self, sample: PackedSample) -> None:
        self.seq_len = self.seq_len or sample.seq_len
        self.add_bin(sample.n_docs, sample.n_tokens)
        self.loss_tokens += int(sample.loss_mask.sum(dtype=np.int64))

    def add_bin(self, segments: int, tokens: int) -> None:
        """One sample of ``segments`` pieces and ``tokens`` real tokens (loss tokens apart)."""
        self.samples += 1
        self.segments += segments
        self.tokens += tokens

    @property
    def efficiency(self) -> float:
        """Fraction of sample positions holding real tokens (1.0 = no padding)."""
        capacity = self.samples * self.seq_len
        return self.tokens / capacity if capacity else 0.0

    @property
    def docs_per_sample(self) -> float:
        """Mean packed segments per sample (a split piece counts as one)."""
        return self.segments / self.samples if self.samples else 0.0

    def as_dict(self) -> dict[str, float | int]:
        out: dict[str, float | int] = asdict(self)
        out["efficiency"] = self.efficiency
        out["docs_per_sample"] = self.docs_per_sample
        return out


def packing_stats(samples: Iterable[PackedSample]) -> PackingStats:
    """Sample-level statistics of already-packed samples (split counts stay 0)."""
    stats = PackingStats()
    for sample in samples:
        stats.add_sample(sample)
    return stats


class Packable(Protocol):
    """What the packer needs of a document: a key, a length, and a way to cut a piece.

    :class:`TokenizedDoc` carries its tokens; a planner that packs references
    (``factory.data.stages.shard_plan``) passes lengths only, and both get the same bins.
    """

    key: str

    def __len__(self) -> int: ...

    def piece(self, index: int, start: int, end: int) -> Self: ...


P = TypeVar("P", bound=Packable)


def _pieces(doc: P, seq_len: int, stats: PackingStats) -> list[P]:
    """Cut a document into ``seq_len``-sized pieces; short documents pass through whole."""
    n = len(doc)
    if n == 0:
        stats.empty_documents += 1
        return []
    stats.documents += 1
    if n <= seq_len:
        return [doc]
    starts = range(0, n, seq_len)
    stats.split_documents += 1
    stats.split_pieces += len(starts)
    return [doc.piece(j, start, min(start + seq_len, n)) for j, start in enumerate(starts)]


def packed_sample(docs: list[TokenizedDoc], seq_len: int, pad_id: int = 0) -> PackedSample:
    """One sample from the pieces of one bin, in bin order, padded to ``seq_len``."""
    tokens = np.full(seq_len, pad_id, dtype=np.int32)
    loss_mask = np.zeros(seq_len, dtype=np.uint8)
    cu_seqlens = np.zeros(len(docs) + 1, dtype=np.int32)
    offset = 0
    for d, doc in enumerate(docs):
        end = offset + len(doc)
        tokens[offset:end] = doc.ids
        loss_mask[offset:end] = doc.mask
        cu_seqlens[d + 1] = end
        offset = end
    return PackedSample(tokens, loss_mask, cu_seqlens, [doc.key for doc in docs])


def _best_fit_window(buffer: list[P], seq_len: int) -> list[list[P]]:
    """Best-fit decreasing over one window; bins are returned in the order they were opened.

    ``free`` holds ``(remaining capacity, bin index)`` of the open bins, kept
    sorted, so the best fit (least remaining space that still fits) is one
    bisect away; ties go to the oldest bin. Full bins leave ``free`` for good.
    """
    order = sorted(buffer, key=lambda doc: (-len(doc), doc.key))
    bins: list[list[P]] = []
    free: list[tuple[int, int]] = []
    for doc in order:
        n = len(doc)
        pos = bisect_left(free, (n, -1))
        if pos < len(free):
            remaining, index = free.pop(pos)
            bins[index].append(doc)
            remaining -= n
        else:
            index, remaining = len(bins), seq_len - n
            bins.append([doc])
        if remaining > 0:
            insort(free, (remaining, index))
    return bins


def pack_bins(
    docs: Iterable[P], seq_len: int, window: int = 4096, stats: PackingStats | None = None
) -> Iterator[list[P]]:
    """The bins (lists of pieces) of :func:`pack_best_fit_decreasing`, without building the samples.

    Counts documents, splits and empty documents into ``stats``; sample-level
    counts are the caller's (it knows the tokens).
    """
    if seq_len <= 0:
        raise ValueError(f"seq_len must be positive, got {seq_len}")
    if window <= 0:
        raise ValueError(f"window must be positive, got {window}")
    stats = stats if stats is not None else PackingStats()
    stats.seq_len = seq_len
    buffer: list[P] = []
    for doc in docs:
        for piece in _pieces(doc, seq_len, stats):
            buffer.append(piece)
            if len(buffer) >= window:
                yield from _best_fit_window(buffer, seq_len)
                buffer = []
    if buffer:
        yield from _best_fit_window(buffer, seq_len)


def pack_best_fit_decreasing(
    docs: Iterable[TokenizedDoc],
    seq_len: int,
    window: int = 4096,
    pad_id: int = 0,
    stats: PackingStats | None = None,
) -> Iterator[PackedSample]:
    """Pack ``docs`` into ``seq_len``-token samples, streaming ``window`` documents at a time.

    Each window (counted in pieces after splitting, so it bounds memory) is
    sorted by length, longest first, ties broken by key, and best-fit into
    bins of capacity ``seq_len``. Windows are packed independently, so a
    window's last bins may be underfull; a larger window packs tighter at the
    cost of memory. Empty documents are dropped (and counted in ``stats``).
    """
    stats = stats if stats is not None else PackingStats()
    for bin_docs in pack_bins(docs, seq_len, window, stats):
        sample = packed_sample(bin_docs, seq_len, pad_id)
        stats.add_sample(sample)
        yield sample
