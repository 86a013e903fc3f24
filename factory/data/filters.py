"""Document filters: text quality heuristics, trajectory rules, CUDA-kernel rules.

Every filter has the same shape, ``check(record, document, params) -> reason | None``
(None keeps the document), and is registered by the ``kind`` it has in a recipe
step (``FILTERS``), so adding a filter family never touches the pipeline.
A check returns the *first* failing reason, so drop counts read as "why this
document went", not as overlapping flags.

Text heuristics use NeMo Curator's and Gopher's published thresholds (reference
data.md §2.1). The definitions are ours and are stated per parameter; words are
whitespace-separated tokens, as in Gopher. The checks run cheapest first, and
the n-gram statistics, the only super-linear work, are computed on integer
word ids with numpy (one sort per n) rather than with Python tuples: this stage
runs over every pretraining byte.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from factory.data.document import Document, RawRecord
from factory.data.formatting import call_parts, declared_tools

__all__ = [
    "FILTERS",
    "CudaKernelParams",
    "FilterSpec",
    "HeuristicParams",
    "TrajectoryParams",
    "cuda_kernel_reason",
    "heuristic_reason",
    "ngram_repetition",
    "text_quality_reason",
    "trajectory_reason",
]


# --- text heuristics --------------------------------------------------------------------


@dataclass(frozen=True)
class HeuristicParams:
    """Thresholds of the text quality heuristics; defaults are Curator's / Gopher's.

    * ``min_words``..``max_words``: whitespace-separated words.
    * mean word length (characters per word) within ``[min, max]``.
    * ``max_symbol_to_word_ratio``: ``#`` per word, and ellipses (``...``/``…``)
      per word, each at most this.
    * ``max_duplicate_line_fraction``: non-empty lines that repeat an earlier
      line, over non-empty lines.
    * ``max_non_alphanumeric_fraction``: characters that are not letters or
      digits (whitespace included, as in Curator), over all characters.
    * ``max_url_ratio``: characters inside URLs (a token starting ``http://``,
      ``https://`` or ``www.``) over all characters.
    * ``max_top_ngram_fraction``: per n, word characters of the most frequent
      word n-gram times its count, over all word characters; an n-gram seen
      once is not counted (a short text is not "repetitive").
    * ``max_duplicate_ngram_fraction``: per n, word characters inside n-grams
      that repeat an earlier occurrence, over all word characters.
    """

    min_words: int = 50
    max_words: int = 100_000
    min_mean_word_length: float = 3.0
    max_mean_word_length: float = 10.0
    max_symbol_to_word_ratio: float = 0.1
    max_duplicate_line_fraction: float = 0.3
    max_non_alphanumeric_fraction: float = 0.25
    max_url_ratio: float = 0.2
    max_top_ngram_fraction: tuple[tuple[int, float], ...] = ((2, 0.20), (3, 0.18), (4, 0.16))
    max_duplicate_ngram_fraction: tuple[tuple[int, float], ...] = (
        (5, 0.15),
        (6, 0.14),
        (7, 0.13),
        (8, 0.12),
        (9, 0.11),
        (10, 0.10),
    )

    def __post_init__(self) -> None:
        for name in ("max_top_ngram_fraction", "max_duplicate_ngram_fraction"):
            # Lists arrive from YAML; tuples keep the params hashable and frozen.
            pairs = tuple((int(n), float(t)) for n, t in getattr(self, name))
            if any(n < 1 for n, _ in pairs):
                raise ValueError(f"{name}: n-gram sizes must be >= 1")
            object.__setattr__(self, name, pairs)


_NOT_ALNUM = re.compile(r"[\W_]+")  # runs of characters that are not letters or digits
_URL = re.compile(r"(?:https?://|www\.|WWW\.)\S+")
# An odd 64-bit multiplier (2^64 / golden ratio) spreads word-id sequences over the hash space.
_MULTIPLIER = np.uint64(0x9E3779B97F4A7C15)
_FILLER = np.uint64(2**64 - 1)
_ASCII_ALNUM = b"0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"


def text_quality_reason(text: str, params: HeuristicParams) -> str | None:
    """The first heuristic ``text`` fails, or None if it passes them all."""
    words = text.split()
    n_words = len(words)
    if not params.min_words <= n_words <= params.max_words:
        return "word_count"
    word_chars = sum(map(len, words))
    mean = word_chars / n_words if n_words else 0.0
    if not params.min_mean_word_length <= mean <= params.max_mean_word_length:
        return "mean_word_length"
    per_word = max(n_words, 1)
    ellipses = text.count("...") + text.count("…")
    if max(text.count("#"), ellipses) / per_word > params.max_symbol_to_word_ratio:
        return "symbol_to_word"
    lines = [line for line in map(str.strip, text.splitlines()) if line]
    if lines and 1 - len(set(lines)) / len(lines) > params.max_duplicate_line_fraction:
        return "duplicate_lines"
    n_chars = max(len(text), 1)
    if text.isascii():  # bytes.translate runs at memory speed; the regex is the Unicode path
        other = len(text.encode("ascii").translate(None, _ASCII_ALNUM))
    else:
        other = len(text) - len(_NOT_ALNUM.sub("", text))
    if other / n_chars > params.max_non_alphanumeric_fraction:
        return "non_alphanumeric"
    if "://" in text or "www." in text or "WWW." in text:  # skip the regex scan when it can't match
        url_chars = sum(len(url) for url in _URL.findall(text))
        if url_chars / n_chars > params.max_url_ratio:
            return "url_ratio"
    top = dict(params.max_top_ngram_fraction)
    dup = dict(params.max_duplicate_ngram_fraction)
    for n, (top_fraction, dup_fraction) in sorted(ngram_repetition(words, {*top, *dup}).items()):
        if n in top and top_fraction > top[n]:
            return f"top_{n}gram"
        if n in dup and dup_fraction > dup[n]:
            return f"duplicate_{n}gram"
    return None


def ngram_repetition(words: list[str], sizes: Iterable[int]) -> dict[int, tuple[float, float]]:
    """``{n: (top fraction, duplicate fraction)}`` of word n-grams, as ``HeuristicParams`` defines them.

    All sizes are computed at once, one row per n, so a document costs a fixed
    handful of numpy calls (one sort) rather than a handful per n: most web
    documents are a few hundred words, where call overhead, not arithmetic,
    is the cost.
    """
    n_words = len(words)
    result = dict.fromkeys(sizes, (0.0, 0.0))
    if any(n < 1 for n in result):
        raise ValueError(f"n-gram sizes must be >= 1, got {sorted(result)}")
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


def heuristic_reason(record: RawRecord, doc: Document, params: HeuristicParams) -> str | None:
    """Text heuristics on the document's full text (what the model will read)."""
    return text_quality_reason(doc.text, params)


# --- trajectories -----------------------------------------------------------------------


@dataclass(frozen=True)
class TrajectoryParams:
    """Rules for agent trajectories (SWE, terminal, search).

    Record fields read:

    * ``finished: bool``: the agent reached its own end (not a step or time
      limit). Missing counts as unfinished.
    * ``tests_passed: bool``, or else ``test_results: {passed: int, failed: int}``
      (passed means ``failed == 0`` and ``passed > 0``). Missing counts as failed.
    * ``messages``: every message is one turn.
    * ``tools`` and each assistant message's ``tool_calls``: a call is well formed
      when its ``name`` is a declared tool and its ``arguments`` are a JSON
      object (a mapping, or a string holding one).
    """

    require_finished: bool = True
    require_tests_passed: bool = True
    max_turns: int = 100
    require_well_formed_tool_calls: bool = True


def trajectory_reason(record: RawRecord, doc: Document, params: TrajectoryParams) -> str | None:
    """``unfinished``, ``tests_failed``, ``too_many_turns``, ``malformed_tool_call`` or None."""
    data = record.data
    if params.require_finished and data.get("finished") is not True:
        return "unfinished"
    if params.require_tests_passed and not _tests_passed(data):
        return "tests_failed"
    messages = data.get("messages")
    messages = messages if isinstance(messages, list) else []
    if len(messages) > params.max_turns:
        return "too_many_turns"
    if params.require_well_formed_tool_calls and not _tool_calls_well_formed(data, messages):
        return "malformed_tool_call"
    return None


def _tests_passed(data: dict[str, Any]) -> bool:
    if "tests_passed" in data:
        return data["tests_passed"] is True
    results = data.get("test_results")
    if not isinstance(results, dict):
        return False
    passed, failed = results.get("passed"), results.get("failed")
    return _is_count(passed) and _is_count(failed) and failed == 0 and passed > 0


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _tool_calls_well_formed(data: dict[str, Any], messages: list[Any]) -> bool:
    try:
        tools = declared_tools(data) or []
    except ValueError:
        return False
    names = set()
    for tool in tools:
        spec = tool.get("function", tool) if isinstance(tool, dict) else {}
        if isinstance(spec, dict) and isinstance(spec.get("name"), str):
            names.add(spec["name"])
    for message in messages:
        calls = message.get("tool_calls") if isinstance(message, dict) else None
        if not calls:
            continue
        if not isinstance(calls, list):
            return False
        for call in calls:
            name, arguments = call_parts(call) or (None, None)
            if not (isinstance(name, str) and name in names and isinstance(arguments, dict)):
                return False
    return True


# --- CUDA kernels -----------------------------------------------------------------------


@dataclass(frozen=True)
class CudaKernelParams:
    """Rules for generated CUDA kernels.

    Record fields read: ``verified: bool`` (the kernel's outputs matched the
    PyTorch reference) and ``benchmark: {reference_ms: float, kernel_ms: float}``;
    speed-up is ``reference_ms / kernel_ms``. ``min_speedup <= 0`` turns the
    speed rule, and the need for a benchmark, off.
    """

    require_verified: bool = True
    min_speedup: float = 1.0


def cuda_kernel_reason(record: RawRecord, doc: Document, params: CudaKernelParams) -> str | None:
    """``unverified``, ``missing_benchmark``, ``slow_kernel`` or None."""
    data = record.data
    if params.require_verified and data.get("verified") is not True:
        return "unverified"
    if params.min_speedup <= 0:
        return None
    bench = data.get("benchmark")
    if not isinstance(bench, dict):
        return "missing_benchmark"
    reference, kernel = bench.get("reference_ms"), bench.get("kernel_ms")
    if not (_positive(reference) and _positive(kernel)):
        return "missing_benchmark"
    if reference / kernel < params.min_speedup:
        return "slow_kernel"
    return None


def _positive(value: Any) -> bool:
    return (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value > 0
    )


# --- registry ---------------------------------------------------------------------------


Check = Callable[[RawRecord, Document], str | None]


@dataclass(frozen=True)
class FilterSpec:
    """A filter family: its parameter type and its check."""

    params: type
    check: Callable[[RawRecord, Document, Any], str | None]

    def bind(self, **values: Any) -> Check:
        """A two-argument check with parameters from ``values``.

        Names the parameter type does not have (a recipe step's ``kind``, say)
        are ignored, so a schema section can be passed as ``**section.model_dump()``.
        """
        known = {f.name for f in fields(self.params)}
        params = self.params(**{k: v for k, v in values.items() if k in known})
        check = self.check

        def bound(record: RawRecord, doc: Document) -> str | None:
            return check(record, doc, params)

        return bound


FILTERS: dict[str, FilterSpec] = {
    "heuristics": FilterSpec(HeuristicParams, heuristic_reason),
    "trajectory": FilterSpec(TrajectoryParams, trajectory_reason),
    "cuda_kernel": FilterSpec(CudaKernelParams, cuda_kernel_reason),
}
"""Filter families by the ``kind`` they have in a recipe step."""
