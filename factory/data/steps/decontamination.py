"""Benchmark decontamination: find training documents that share a word n-gram with an eval item.

The default is NeMo Curator's ``TaskDecontamination`` rule (docs/data.md,
Decontamination): word 13-grams, and items shorter than 13 words (but at least 8, Curator's
``min_ngram_size``) match as their whole word sequence. Shorter items (answer
letters, numbers, one-word labels) are skipped: they occur in ordinary text, so a
match says nothing about contamination. DataTrove uses 12-grams; 13 is the
stricter-to-trigger, GPT-3-era choice.

Text is normalized exactly as for dedup (``dedup_hashing.normalize_for_dedup``: lowercase,
punctuation and whitespace runs become one separator), so case and punctuation
never hide a match. Every n-gram is a 64-bit hash (``dedup_hashing.ngram_hashes_multi``);
the index is a sorted ``uint64`` array probed with ``searchsorted`` behind a bitmap
prefilter, so a document costs a few numpy passes, not a Python loop per n-gram.
"""

from __future__ import annotations

import gzip
import json
from bisect import bisect_right
from collections.abc import Iterable, Iterator
from itertools import accumulate
from pathlib import Path
from typing import Any

import numpy as np

from factory.data.steps.dedup_hashing import Prepared, ngram_hashes_multi, prepare

__all__ = ["DEFAULT_MIN_WORDS", "DEFAULT_N", "NgramIndex", "read_benchmark_items"]

DEFAULT_N = 13
DEFAULT_MIN_WORDS = 8


def _strings(value: Any) -> Iterator[str]:
    """Every string inside a JSON value (nested lists and objects included)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from _strings(item)


def read_benchmark_items(path: Path) -> Iterator[str]:
    """Items of one benchmark file: every string value of every record of a ``.jsonl``
    file or of a ``.json`` document, so question, answer, choices and passage all
    count; or each non-empty line of a ``.txt`` file. ``.gz`` files are decompressed."""
    path = Path(path)
    kind = path.suffixes[-2] if path.suffix == ".gz" and len(path.suffixes) > 1 else path.suffix
    if kind not in (".jsonl", ".json", ".txt"):
        raise ValueError(f"{path}: benchmark files must be .jsonl, .json or .txt")
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as lines:
        if kind == ".json":
            yield from _strings(json.load(lines))
            return
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            if kind == ".txt":
                yield line.rstrip("\n")
                continue
            try:
                yield from _strings(json.loads(line))
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{number}: not a JSON record: {err.msg}") from err


class NgramIndex:
    """Hashes of every word n-gram of a set of benchmark items.

    ``n``-grams of items with at least ``n`` words, plus the whole word sequence of
    items with ``min_words <= words < n``; ``lengths`` are the window sizes a
    document is probed with (``n`` and each short item's length).
    """

    def __init__(self, hashes: np.ndarray, n: int = DEFAULT_N, lengths: Iterable[int] = ()) -> None:
        self.n = n
        self.lengths = tuple(sorted({n, *lengths}, reverse=True))
        self._hashes = np.unique(np.asarray(hashes, dtype=np.uint64))
        # Bitmap over the top bits, ~1/8 full: most document n-grams stop at one
        # gather instead of a binary search through the whole index.
        bits = int(np.clip(np.ceil(np.log2(max(self._hashes.size, 1) * 8)), 16, 28))
        self._shift = np.uint64(64 - bits)
        self._bitmap = np.zeros(1 << bits, dtype=bool)
        self._bitmap[self._hashes >> self._shift] = True
        self.items = 0  # how many items were indexed / skipped as too short (for reports)
        self.skipped = 0

    @classmethod
    def from_items(
        cls, items: Iterable[str], n: int = DEFAULT_N, min_words: int = DEFAULT_MIN_WORDS
    ) -> NgramIndex:
        """Index benchmark items (strings); see the class docstring for short items."""
        if not 1 <= min_words <= n:
            raise ValueError(f"need 1 <= min_words <= n, got min_words={min_words}, n={n}")
        parts: list[np.ndarray] = []
        lengths: set[int] = set()
        indexed = skipped = 0
        for item in items:
            hashes = prepare(item).hashes
            if hashes.size < min_words:
                skipped += 1
                continue
            size = min(n, hashes.size)
            parts.append(ngram_hashes_multi(hashes, (size,))[size])
            lengths.add(size)
            indexed += 1
        index = cls(np.concatenate(parts) if parts else np.empty(0, np.uint64), n, lengths)
        index.items, index.skipped = indexed, skipped
        return index

    @classmethod
    def from_files(
        cls, paths: Iterable[Path], n: int = DEFAULT_N, min_words: int = DEFAULT_MIN_WORDS
    ) -> NgramIndex:
        """Index every item of the benchmark files (see ``read_benchmark_items``)."""
        items = (item for path in paths for item in read_benchmark_items(Path(path)))
        return cls.from_items(items, n, min_words)

    def __len__(self) -> int:
        return int(self._hashes.size)

    def first_match(self, text: str | Prepared) -> str | None:
        """The earliest matching n-gram of ``text`` (normalized words), else None.

        A document shorter than an n-gram cannot contain it: windows never extend
        past the document. On ties of position the longer window wins.
        """
        if self._hashes.size == 0:
            return None
        doc = prepare(text)
        windows = [
            (m, h) for m, h in ngram_hashes_multi(doc.hashes, self.lengths).items() if h.size
        ]
        if not windows:
            return None
        # One probe over every size's windows: a bitmap gather, then a binary search
        # only for the few hashes whose bitmap bit is set.
        flat = np.concatenate([h for _, h in windows]) if len(windows) > 1 else windows[0][1]
        candidates = np.flatnonzero(self._bitmap[flat >> self._shift])
        if candidates.size == 0:
            return None
        probe = flat[candidates]
        slots = np.minimum(np.searchsorted(self._hashes, probe), self._hashes.size - 1)
        hits = candidates[self._hashes[slots] == probe].tolist()
        if not hits:
            return None
        starts = list(accumulate((h.size for _, h in windows[:-1]), initial=0))
        found = []  # (position, -size): earliest first, then longest
        for hit in hits:
            k = bisect_right(starts, hit) - 1
            found.append((hit - starts[k], -windows[k][0]))
        start, neg_size = min(found)
        return b" ".join(doc.words[start : start - neg_size]).decode("utf-8")

    def contaminated(self, text: str | Prepared) -> bool:
        """True if ``text`` contains any indexed n-gram (or a whole short item)."""
        return self.first_match(text) is not None
