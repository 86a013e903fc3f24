"""Text quality heuristics (recipe step ``kind: heuristics``): NeMo Curator's and Gopher's thresholds.

The thresholds are the published ones (docs/data.md, Heuristic filters); the
definitions are ours and are stated per field of ``HeuristicFilter``. The checks
run cheapest first, and the n-gram statistics, the only super-linear work, come
from :mod:`factory.data.steps.ngram_repetition` (compiled with numba where it is
installed): this step runs over every pretraining byte.
"""

from __future__ import annotations

import re

from factory.data.steps.filter_registry import register_filter
from factory.data.steps.ngram_repetition import Repetition, repetition_of
from factory.data.steps.records import Document, RawRecord
from factory.schemas.data_recipe import HeuristicFilter

__all__ = ["heuristic_reason", "text_quality_reason"]

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


@register_filter(HeuristicFilter)
def heuristic_reason(record: RawRecord, doc: Document, params: HeuristicFilter) -> str | None:
    """Text heuristics on the document's full text (what the model will read)."""
    return text_quality_reason(doc.text, params)
