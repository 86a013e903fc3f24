"""Best-fit-decreasing packing: conservation, boundaries, masks, determinism and efficiency."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from factory.data.stages.packing import (
    PIECE_SEPARATOR,
    PackedSample,
    PackingStats,
    TokenizedDoc,
    pack_best_fit_decreasing,
    packing_stats,
)

PAD = -1  # never a real id in these tests, so padding is recognisable


def make_docs(lengths: list[int], seed: int = 0) -> list[TokenizedDoc]:
    rng = np.random.default_rng(seed)
    return [
        TokenizedDoc(
            key=f"src:{i}",
            ids=rng.integers(0, 50_000, size=n, dtype=np.int32),
            mask=rng.integers(0, 2, size=n, dtype=np.uint8),
        )
        for i, n in enumerate(lengths)
    ]


def segments(samples: list[PackedSample]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Every packed segment by key, checking that no key is packed twice."""
    found: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for sample in samples:
        for d, key in enumerate(sample.doc_keys):
            start, end = int(sample.cu_seqlens[d]), int(sample.cu_seqlens[d + 1])
            assert key not in found, f"{key} packed twice"
            found[key] = (sample.tokens[start:end], sample.loss_mask[start:end])
    return found


def reassemble(found: dict[str, tuple[np.ndarray, np.ndarray]], doc: TokenizedDoc, seq_len: int):
    """The tokens and mask of ``doc`` rebuilt from its packed segment or pieces, in order."""
    if len(doc) <= seq_len:
        return found.pop(doc.key)
    n_pieces = -(-len(doc) // seq_len)
    parts = [found.pop(f"{doc.key}{PIECE_SEPARATOR}{j}") for j in range(n_pieces)]
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])


@settings(max_examples=60, deadline=None, derandomize=True, database=None)
@given(
    lengths=st.lists(st.integers(0, 300), min_size=0, max_size=60),
    seq_len=st.integers(1, 256),
    window=st.integers(1, 40),
    seed=st.integers(0, 2**16),
)
def test_packing_conserves_every_token_in_order(
    lengths: list[int], seq_len: int, window: int, seed: int
) -> None:
    docs = make_docs(lengths, seed)
    stats = PackingStats()
    samples = list(pack_best_fit_decreasing(docs, seq_len, window=window, pad_id=PAD, stats=stats))

    for sample in samples:
        assert sample.tokens.shape == (seq_len,) and sample.tokens.dtype == np.int32
        assert sample.loss_mask.shape == (seq_len,) and sample.loss_mask.dtype == np.uint8
        cu = sample.cu_seqlens
        assert cu.dtype == np.int32 and cu.shape == (sample.n_docs + 1,) and cu[0] == 0
        assert np.all(np.diff(cu) > 0), "every packed segment is non-empty"
        assert cu[-1] <= seq_len
        assert np.all(sample.tokens[cu[-1] :] == PAD)
        assert np.all(sample.loss_mask[cu[-1] :] == 0)
        assert np.all(sample.tokens[: cu[-1]] != PAD)

    found = segments(samples)
    for doc in docs:
        if len(doc) == 0:
            continue
        ids, mask = reassemble(found, doc, seq_len)
        np.testing.assert_array_equal(ids, doc.ids)
        np.testing.assert_array_equal(mask, doc.mask)
    assert not found, f"segments with no source document: {sorted(found)}"

    nonempty = [n for n in lengths if n]
    assert stats.tokens == sum(nonempty)
    assert stats.samples == len(samples)
    assert stats.empty_documents == len(lengths) - len(nonempty)
    assert stats.split_documents == sum(1 for n in nonempty if n > seq_len)
    assert stats.split_pieces == sum(-(-n // seq_len) for n in nonempty if n > seq_len)


@settings(max_examples=25, deadline=None, derandomize=True, database=None)
@given(lengths=st.lists(st.integers(1, 200), max_size=50), seq_len=st.integers(8, 256))
def test_packing_is_deterministic(lengths: list[int], seq_len: int) -> None:
    def run() -> list[PackedSample]:
        return list(pack_best_fit_decreasing(make_docs(lengths), seq_len, window=16))

    first, second = run(), run()
    assert len(first) == len(second)
    for a, b in zip(first, second, strict=True):
        assert a.doc_keys == b.doc_keys
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_array_equal(a.loss_mask, b.loss_mask)
        np.testing.assert_array_equal(a.cu_seqlens, b.cu_seqlens)


def test_best_fit_picks_the_tightest_open_bin() -> None:
    # 7 opens bin 0 (3 left), 4 opens bin 1 (6 left), 4 joins bin 1 (2 left). The last doc, 1,
    # goes to bin 1, the tightest fit; first-fit would have put it into bin 0.
    docs = make_docs([7, 4, 4, 1])
    samples = list(pack_best_fit_decreasing(docs, 10))
    assert [s.doc_keys for s in samples] == [["src:0"], ["src:1", "src:2", "src:3"]]
    np.testing.assert_array_equal(samples[1].cu_seqlens, [0, 4, 8, 9])


def test_equal_lengths_are_ordered_by_key() -> None:
    docs = [TokenizedDoc(k, np.ones(4, np.int32), np.ones(4, np.uint8)) for k in "cab"]
    (sample,) = pack_best_fit_decreasing(docs, 12)
    assert sample.doc_keys == ["a", "b", "c"]


def test_long_documents_are_split_not_truncated() -> None:
    doc = TokenizedDoc("long", np.arange(25, dtype=np.int32), np.ones(25, np.uint8))
    stats = PackingStats()
    samples = list(pack_best_fit_decreasing([doc], 10, stats=stats))
    keys = sorted(k for s in samples for k in s.doc_keys)
    assert keys == ["long#0", "long#1", "long#2"]
    assert (stats.split_documents, stats.split_pieces, stats.documents) == (1, 3, 1)
    assert stats.tokens == 25


def test_efficiency_on_uniform_lengths() -> None:
    rng = np.random.default_rng(1234)
    lengths = rng.integers(32, 1025, size=4096).tolist()
    docs = [
        TokenizedDoc(f"d{i}", np.ones(n, np.int32), np.ones(n, np.uint8))
        for i, n in enumerate(lengths)
    ]
    stats = PackingStats()
    samples = list(pack_best_fit_decreasing(docs, 2048, window=1024, stats=stats))
    assert stats.efficiency >= 0.9
    assert stats.efficiency == pytest.approx(packing_stats(samples).efficiency)
    assert stats.docs_per_sample == pytest.approx(len(lengths) / len(samples))
    assert stats.as_dict()["split_documents"] == 0


def test_tokenized_doc_validates_alignment() -> None:
    with pytest.raises(ValueError, match="aligned"):
        TokenizedDoc("x", np.zeros(3, np.int32), np.zeros(2, np.uint8))
    with pytest.raises(ValueError, match="0 or 1"):
        TokenizedDoc("x", np.zeros(2, np.int32), np.array([0, 2]))
    with pytest.raises(ValueError, match="seq_len"):
        list(pack_best_fit_decreasing([], 0))
