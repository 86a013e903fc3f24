"""Word n-gram repetition of a document: Gopher's top and duplicate n-gram fractions.

Two implementations of the same definitions (``HeuristicFilter`` states them per field):

* :func:`ngram_repetition`, numpy over ``str.split()`` words mapped to integer ids
  (one sort for all sizes). It is the reference, and what runs without numba.
* :mod:`factory.data.steps.ngram_jit`, compiled with numba from the text's UTF-8 bytes.
  Curation uses it when numba imports (``pip install factory[data]`` brings it):
  about 10x less time a document, because the per-document Python and numpy calls
  of the reference, not its arithmetic, were the cost.

:func:`repetition_of` picks one and hands the filter a function of the n-gram sizes.
Tests hold the two to the same results and the reference to a naive definition.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from types import ModuleType

import numpy as np

from factory.data.steps.numba_kernels import compiled_kernels

__all__ = ["Repetition", "jit_available", "ngram_repetition", "repetition_of"]

Repetition = Callable[[Iterable[int]], dict[int, tuple[float, float]]]
"""n-gram sizes -> ``{n: (top fraction, duplicate fraction)}`` of one document."""

# An odd 64-bit multiplier (2^64 / golden ratio) spreads word-id sequences over the hash space.
_MULTIPLIER = np.uint64(0x9E3779B97F4A7C15)
_FILLER = np.uint64(2**64 - 1)


def _jit() -> ModuleType | None:
    return compiled_kernels("ngram_jit")


def jit_available() -> bool:
    """Whether curation measures n-grams with the compiled kernel (numba importable)."""
    return _jit() is not None


def _sizes(sizes: Iterable[int]) -> list[int]:
    wanted = sorted(set(sizes))
    if any(n < 1 for n in wanted):
        raise ValueError(f"n-gram sizes must be >= 1, got {wanted}")
    return wanted


def repetition_of(text: str, words: list[str]) -> Repetition:
    """The n-gram statistics of ``text`` (whose ``str.split()`` is ``words``), by the
    compiled kernel where numba is installed, else by :func:`ngram_repetition`."""
    jit = _jit()
    if jit is None:
        return functools.partial(ngram_repetition, words)
    # surrogatepass: JSON may carry lone surrogates; each still counts as one character.
    data = np.frombuffer(text.encode("utf-8", "surrogatepass"), np.uint8)
    hashes, lengths = jit.split_hashed_words(data)

    def measure(sizes: Iterable[int]) -> dict[int, tuple[float, float]]:
        wanted = _sizes(sizes)
        rows = jit.repetition_from_hashes(hashes, lengths, np.array(wanted, np.int64))
        return {n: (float(top), float(dup)) for n, (top, dup) in zip(wanted, rows, strict=True)}

    return measure


def ngram_repetition(words: list[str], sizes: Iterable[int]) -> dict[int, tuple[float, float]]:
    """``{n: (top fraction, duplicate fraction)}`` of word n-grams, as ``HeuristicFilter`` defines them.

    All sizes are computed at once, one row per n, so a document costs a fixed
    handful of numpy calls (one sort) rather than a handful per n: most web
    documents are a few hundred words, where call overhead, not arithmetic,
    is the cost.
    """
    n_words = len(words)
    result = dict.fromkeys(_sizes(sizes), (0.0, 0.0))
    sizes = sorted(n for n in result if n < n_words)  # fewer than 2 n-grams: no repeats
    word_chars = sum(map(len, words))
    if not sizes or word_chars == 0:
        return result
    # Word -> id in first-seen order: deterministic, unlike hash(str), and C-speed.
    vocab = dict.fromkeys(words)
    for i, word in enumerate(vocab):
        vocab[word] = i
    ids = np.fromiter(map(vocab.__getitem__, words), np.uint64, n_words)
    lengths = np.fromiter(map(len, words), np.int64, n_words)
    starts = np.zeros(n_words + 1, np.int64)  # starts[i]: word characters before word i
    np.cumsum(lengths, out=starts[1:])

    # keys[r, i]: hash of the sizes[r]-gram at word i in the high bits, i in the
    # low bits, so a plain sort (several times faster than argsort) groups equal
    # n-grams in text order. A row's tail, where no n-gram starts, gets distinct
    # filler hashes from the top of the range so it never repeats.
    shift = np.uint64(max(n_words.bit_length(), 1))
    position = np.arange(n_words, dtype=np.uint64)
    width = n_words - sizes[0] + 1
    filler = (_FILLER - position[:width]) << shift
    keys = np.empty((len(sizes), width), np.uint64)
    grams = np.zeros(n_words, np.uint64)
    row = 0
    for n in range(1, sizes[-1] + 1):
        m = n_words - n + 1
        grams = grams[:m]
        grams *= _MULTIPLIER
        grams += ids[n - 1 :]
        if n == sizes[row]:
            np.left_shift(grams, shift, out=keys[row, :m])
            keys[row, m:] = filler[: width - m]
            row += 1
    keys |= position[:width]
    keys.sort(axis=1)
    order = (keys & ((np.uint64(1) << shift) - np.uint64(1))).astype(np.int64)
    hashes = keys >> shift
    same = hashes[:, 1:] == hashes[:, :-1]
    size = np.array(sizes)

    # Duplicate fraction: words inside any occurrence after an n-gram's first.
    rows, cols = np.nonzero(same)
    repeats = order[rows, cols + 1]
    edges = np.zeros((len(sizes), n_words + 1), np.int32)
    edges[rows, repeats] += 1  # (row, position) pairs are unique, so += is exact
    edges[rows, np.minimum(repeats + size[rows], n_words)] -= 1
    dup_fraction = (np.cumsum(edges[:, :-1], axis=1) > 0) @ lengths / word_chars

    # Top fraction: the most frequent n-gram (first seen wins a tie) x its characters.
    run_start = np.flatnonzero(np.concatenate([np.ones((len(sizes), 1), bool), ~same], 1))
    run_len = np.diff(run_start, append=keys.size)
    run_row = run_start // width
    first_run = np.searchsorted(run_start, np.arange(len(sizes)) * width)
    most = np.maximum.reduceat(run_len, first_run)
    first_at = np.where(run_len == most[run_row], order.ravel()[run_start], n_words)
    pos = np.minimum.reduceat(first_at, first_run)
    gram_chars = starts[np.minimum(pos + size, n_words)] - starts[np.minimum(pos, n_words)]
    # A single occurrence is no repetition: only n-grams seen twice or more count.
    top_fraction = np.where(most >= 2, most * gram_chars, 0) / word_chars
    result.update(
        zip(sizes, zip(top_fraction.tolist(), dup_fraction.tolist(), strict=True), strict=True)
    )
    return result
