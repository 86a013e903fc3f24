"""Megatron-core's own ``IndexedDataset`` reads the ``.bin/.idx`` pairs we write, document for
document (``factory.data.shards.megatron_index``)."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest

from factory.data.shards.megatron_index import IndexedDatasetWriter, read_indexed

indexed_dataset = pytest.importorskip("megatron.core.datasets.indexed_dataset")


@pytest.mark.parametrize("vocab_size", [32000, 131072])
def test_megatron_core_reads_our_indexed_dataset(tmp_path: Path, vocab_size: int) -> None:
    rng = np.random.default_rng(1)
    docs = [rng.integers(0, vocab_size, size=int(n)) for n in [5, 0, 17, 1, 300, 64]]
    prefix = tmp_path / "text_document"
    with IndexedDatasetWriter(prefix, vocab_size=vocab_size) as writer:
        for doc in docs:
            writer.add_document(doc)
    with warnings.catch_warnings():  # megatron-core warns about optional GPU-only extras
        warnings.simplefilter("ignore")
        theirs = indexed_dataset.IndexedDataset(str(prefix), mmap=True)
    ours = read_indexed(prefix)
    assert len(theirs) == len(docs) == len(ours)
    assert list(theirs.document_indices) == list(range(len(docs) + 1))
    for i, doc in enumerate(docs):
        np.testing.assert_array_equal(theirs[i], doc)
        np.testing.assert_array_equal(theirs[i], ours[i])
        assert theirs[i].dtype == ours[i].dtype
