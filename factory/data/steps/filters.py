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
the only super-linear work, come from :mod:`factory.data.steps.ngram_repetition` (compiled with
numba where it is installed): this stage runs over every pretraining byte.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from factory.data.steps.formatting import call_parts, declared_tools
from factory.data.steps.ngram_repetition import Repetition, repetition_of
from factory.data.steps.records import Document, RawRecord
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
    "text_quality_reason",
    "trajectory_reason",
]


# --- text heuristics --------------------------------------------------------------------


_NOT_ALNUM = re.compile(r"[\W_]+")  # runs of characters that are not letters or digits
_URL = re.compile(r"(?:https?://|www\.|WWW\.)\S+")
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
    return _ngram_reason(repetition_of(text, words), top, dup)


def _ngram_reason(
    repetition: Repetition, top: dict[int, float], dup: dict[int, float]
) -> str | None:
    """The first n-gram rule a document fails (by n, top before duplicate), or None.

    The duplicate fraction never grows with n: a repeated (n+1)-gram's words are
    covered by two repeated n-grams. So when the smallest duplicate size is at
    or under every larger size's threshold, those sizes cannot fail and are not
    computed (on web text: about 19 documents in 20, and nearly half the work).
    """
    first = min(dup, default=None)
    later = {n for n in dup if n != first}
    stats = repetition({*top, *dup} - later)
    if later and stats[first][1] > min(dup[n] for n in later):  # type: ignore[index]
        stats.update(repetition(later))
    for n, (top_fraction, dup_fraction) in sorted(stats.items()):
        if n in top and top_fraction > top[n]:
            return f"top_{n}gram"
        if n in dup and dup_fraction > dup[n]:
            return f"duplicate_{n}gram"
    return None


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
