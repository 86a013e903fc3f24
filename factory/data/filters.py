"""Document filters: text quality heuristics, trajectory rules, CUDA-kernel rules.

Every filter has the same shape, ``check(record, document, params) -> reason | None``
(None keeps the document), where ``params`` is the recipe step itself (its
section in ``schemas/data_recipe.py``, which declares and documents every
threshold). Filters are registered by the ``kind`` they have in a recipe step
(``FILTERS``), so adding a filter family never touches the pipeline. A check
returns the *first* failing reason, so drop counts read as "why this document
went", not as overlapping flags.

Text heuristics use NeMo Curator's and Gopher's published thresholds
(docs/data.md, Heuristic filters); the definitions are ours and are stated per field of
``HeuristicFilter``. The checks run cheapest first, and the n-gram statistics,
the only super-linear work, are computed on integer word ids with numpy (one
sort per n) rather than with Python tuples: this stage runs over every
pretraining byte.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import numpy as np

from factory.data.document import Document, RawRecord
from factory.data.formatting import call_parts, declared_tools
from factory.schemas.data_recipe import (
    FILTER_STEPS,
    CudaKernelFilter,
    HeuristicFilter,
    TrajectoryFilter,
)

__all__ = [
    "FILTERS",
    "FilterSpec",
    "cuda_kernel_reason",
    "heuristic_reason",
    "ngram_repetition",
    "text_quality_reason",
    "trajectory_reason",
]


# --- text heuristics --------------------------------------------------------------------


_NOT_ALNUM = re.compile(r"[\W_]+")  # runs of characters that are not letters or digits
_URL = re.compile(r"(?:https?://|www\.|WWW\.)\S+")
# An odd 64-bit multiplier (2^64 / golden ratio) spreads word-id sequences over the hash space.
_MULTIPLIER = np.uint64(0x9E3779B97F4A7C15)
_FILLER = np.uint64(2**64 - 1)
_ASCII_ALNUM = b"0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"


def text_quality_reason(text: str, params: HeuristicFilter) -> str | None:
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
    return _ngram_reason(words, top, dup)


def _ngram_reason(words: list[str], top: dict[int, float], dup: dict[int, float]) -> str | None:
    """The first n-gram rule ``words`` fail (by n, top before duplicate), or None.

    The duplicate fraction never grows with n: a repeated (n+1)-gram's words are
    covered by two repeated n-grams. So when the smallest duplicate size is at
    or under every larger size's threshold, those sizes cannot fail and are not
    computed (on web text: about 19 documents in 20, and nearly half the work).
    """
    first = min(dup, default=None)
    later = {n for n in dup if n != first}
    stats = ngram_repetition(words, {*top, *dup} - later)
    if later and stats[first][1] > min(dup[n] for n in later):  # type: ignore[index]
        stats.update(ngram_repetition(words, later))
    for n, (top_fraction, dup_fraction) in sorted(stats.items()):
        if n in top and top_fraction > top[n]:
            return f"top_{n}gram"
        if n in dup and dup_fraction > dup[n]:
            return f"duplicate_{n}gram"
    return None


def ngram_repetition(words: list[str], sizes: Iterable[int]) -> dict[int, tuple[float, float]]:
    """``{n: (top fraction, duplicate fraction)}`` of word n-grams, as ``HeuristicFilter`` defines them.

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


def heuristic_reason(record: RawRecord, doc: Document, params: HeuristicFilter) -> str | None:
    """Text heuristics on the document's full text (what the model will read)."""
    return text_quality_reason(doc.text, params)


# --- trajectories -----------------------------------------------------------------------


def trajectory_reason(record: RawRecord, doc: Document, params: TrajectoryFilter) -> str | None:
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


def cuda_kernel_reason(record: RawRecord, doc: Document, params: CudaKernelFilter) -> str | None:
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
P = TypeVar("P", HeuristicFilter, TrajectoryFilter, CudaKernelFilter)


@dataclass(frozen=True)
class FilterSpec(Generic[P]):
    """A filter family: its recipe step type (which is its parameter type) and its check."""

    params: type[P]
    check: Callable[[RawRecord, Document, P], str | None]

    def bind(self, params: P) -> Check:
        """A two-argument check running with ``params``, a validated recipe step.

        Only the step type itself is accepted: parameters come from one
        declaration, so a key the filter does not know has already failed
        validation (``extra="forbid"``) and cannot be silently dropped here.
        """
        if not isinstance(params, self.params):
            raise TypeError(f"{self.params.__name__} expected, got {type(params).__name__}")
        check = self.check

        def bound(record: RawRecord, doc: Document) -> str | None:
            return check(record, doc, params)

        return bound


FILTERS: dict[str, FilterSpec[Any]] = {
    spec.params.model_fields["kind"].default: spec
    for spec in (
        FilterSpec(HeuristicFilter, heuristic_reason),
        FilterSpec(TrajectoryFilter, trajectory_reason),
        FilterSpec(CudaKernelFilter, cuda_kernel_reason),
    )
}
"""Filter families by the ``kind`` they have in a recipe step."""
if {spec.params for spec in FILTERS.values()} != set(FILTER_STEPS):  # pragma: no cover
    raise ImportError("every filter step of schemas/data_recipe.py needs a check here")
