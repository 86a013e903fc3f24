"""The compiled n-gram kernel against the numpy reference, on text as str.split() sees it."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from factory.data.steps import ngram_jit as jit
from factory.data.steps import ngram_repetition as ngrams
from factory.data.steps.ngram_repetition import jit_available, ngram_repetition, repetition_of

SIZES = range(1, 11)
# Words and separators chosen to hit every branch of the UTF-8 splitter: 1-4 byte code
# points, a lone surrogate (JSON can carry one), and Unicode whitespace str.split() honours.
WORDS = ["a", "bb", "ccc", "é", "日本", "𝔘𝔫𝔦", "\ud800x", "a_b", "ÿ"]
SPACES = [" ", "\t", "\n", "\r\n", "\x0b", "\x1c", "\x85", "\xa0", "\u2003", "\u3000", "\u2029"]


def _utf8(text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-8", "surrogatepass"), np.uint8)


def test_curation_uses_the_kernel_when_numba_is_installed() -> None:
    assert jit_available()


def test_without_numba_the_reference_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ngrams, "_jit", lambda: None)
    words = ["a", "b", "a", "b", "c"]
    assert repetition_of("a b a b c", words)(SIZES) == ngram_repetition(words, SIZES)


def test_the_splitter_honours_exactly_the_whitespace_of_str_split() -> None:
    spaces = [c for c in range(0x110000) if jit._is_space(c)]
    assert spaces == [c for c in range(0x110000) if chr(c).isspace()]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(WORDS), st.sampled_from(SPACES)), max_size=60))
def test_words_are_those_of_str_split(pieces: list[tuple[str, str]]) -> None:
    text = "".join(word + space for word, space in pieces)
    hashes, lengths = jit.split_hashed_words(_utf8(text))
    words = text.split()
    assert lengths.tolist() == [len(w) for w in words]
    by_word: dict[str, int] = {}
    for word, value in zip(words, hashes.tolist(), strict=True):
        assert by_word.setdefault(word, value) == value  # equal words, equal hashes
    assert len(set(by_word.values())) == len(by_word)  # and distinct ones differ


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from(WORDS), st.sampled_from(SPACES)), max_size=80),
    st.sets(st.integers(1, 10), min_size=1),
)
def test_the_kernel_equals_the_reference(pieces: list[tuple[str, str]], sizes: set[int]) -> None:
    text = " ".join(word + space for word, space in pieces)
    words = text.split()
    assert repetition_of(text, words)(sizes) == ngram_repetition(words, sizes)


def test_the_kernel_equals_the_reference_on_web_like_text() -> None:
    """Long documents with repeated lines and boilerplate, where the top n-gram and its
    tie-break (first seen) matter."""
    rng = np.random.default_rng(0)
    vocab = [f"w{i}" for i in range(40)] + ["the", "of", "and"]
    for _ in range(50):
        line = " ".join(rng.choice(vocab, size=int(rng.integers(3, 12))).tolist())
        body = rng.choice(vocab, size=int(rng.integers(0, 2000))).tolist()
        text = "\n".join([line, " ".join(body), line, line])
        words = text.split()
        assert repetition_of(text, words)(SIZES) == ngram_repetition(words, SIZES)


def test_sizes_below_one_are_refused_by_both() -> None:
    for measure in (repetition_of("a b", ["a", "b"]), lambda s: ngram_repetition(["a"], s)):
        with pytest.raises(ValueError, match="n-gram sizes"):
            measure([0, 2])
