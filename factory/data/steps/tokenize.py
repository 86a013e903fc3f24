"""Tokenization with Hugging Face ``tokenizers``; the default tokenizer ships in the repo.

Each document's segments are encoded separately and concatenated, so the loss
mask is exact at segment boundaries (a BPE merge never straddles a trained and
an untrained span). The end-of-text token closes every document and trains as the
document's last segment does: a text document's end trains, a chat document's does not
(it ends on the newline after the last ``<|im_end|>``, context: an SFT objective trains
on assistant turns only, and a chat model stops at ``<|im_end|>``).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np

from factory.data.steps.records import Document
from factory.loading.recipe import DEFAULT_TOKENIZER

__all__ = ["DEFAULT_TOKENIZER", "DocumentTokenizer", "Encoded"]

EOS = "<|endoftext|>"
PAD = "<pad>"


class Encoded(NamedTuple):
    """One document's tokens: ``ids`` int32 and, aligned, ``mask`` uint8 (1 where the token
    trains)."""

    ids: np.ndarray
    mask: np.ndarray


class DocumentTokenizer:
    """A ``tokenizer.json`` for documents: segments encoded apart, end-of-text appended."""

    def __init__(self, path: Path | None = None, eos: bool = True) -> None:
        from tokenizers import Tokenizer

        self.path = path or DEFAULT_TOKENIZER
        self.tokenizer = Tokenizer.from_file(str(self.path))
        self.eos_id = self.tokenizer.token_to_id(EOS) if eos else None
        pad = self.tokenizer.token_to_id(PAD)
        self.pad_id = 0 if pad is None else pad
        self.vocab_size = self.tokenizer.get_vocab_size()

    def encode(self, docs: Sequence[Document]) -> list[Encoded]:
        """Tokenize a batch (one Rust call for all segments of all documents)."""
        texts = [text for doc in docs for text, _ in doc.segments]
        encodings = self.tokenizer.encode_batch_fast(texts, add_special_tokens=False)
        out, cursor = [], 0
        for doc in docs:
            ids: list[np.ndarray] = []
            masks: list[np.ndarray] = []
            for _, trains in doc.segments:
                piece = np.asarray(encodings[cursor].ids, dtype=np.int32)
                cursor += 1
                ids.append(piece)
                masks.append(np.full(piece.shape, trains, dtype=np.uint8))
            if self.eos_id is not None:
                ids.append(np.asarray([self.eos_id], dtype=np.int32))
                last_trains = doc.segments[-1][1] if doc.segments else True
                masks.append(np.full(1, last_trains, dtype=np.uint8))
            out.append(Encoded(np.concatenate(ids), np.concatenate(masks)))
        return out
