"""The compiled MinHash signature against the numpy path: the same bits, always."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from factory.data.steps import minhash_jit
from factory.data.steps.dedup_hashing import MinHasher, prepare
from factory.data.steps.numba_kernels import KERNELS, compiled_kernels

words = st.lists(st.sampled_from(["a", "b", "c", "dé", "日本", "x1", "the", "of"]), max_size=80)


def test_every_kernel_loads_where_numba_is_installed() -> None:
    assert [compiled_kernels(name) is not None for name in KERNELS] == [True] * len(KERNELS)
    assert compiled_kernels("minhash_jit") is minhash_jit
    with pytest.raises(ValueError, match="unknown kernel"):
        compiled_kernels("nope")


@settings(max_examples=200, deadline=None)
@given(words, st.integers(1, 10), st.integers(1, 256), st.integers(0, 2**32))
def test_signatures_equal_the_numpy_path(
    text: list[str], shingle: int, num_perm: int, seed: int
) -> None:
    """Documents shorter than a shingle (one shingle of all words) and empty ones included."""
    hasher = MinHasher(num_perm, shingle, seed)
    prepared = prepare(" ".join(text))
    compiled, reference = hasher.signature(prepared), hasher._signature_numpy(prepared)
    assert compiled.dtype == reference.dtype == np.uint32
    assert np.array_equal(compiled, reference)


def test_long_documents_cross_the_numpy_paths_blocks() -> None:
    rng = np.random.default_rng(0)
    text = " ".join(f"w{i}" for i in rng.integers(0, 500, 6000))  # > 2048 shingles
    hasher = MinHasher()
    assert np.array_equal(hasher.signature(text), hasher._signature_numpy(text))
