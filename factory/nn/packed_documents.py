"""Packed documents: the document index of every position, and what may not cross a boundary.

A packed training sample concatenates documents; its ``cu_seqlens`` (cumulative
lengths, starting at 0) say where each begins. The graph takes the equivalent
``document_ids`` [batch, seq] (the index of the document at each position,
non-decreasing along a row): attention masks keys of other documents, the
Mamba conv and scan reset their state at each boundary, and no loss target
is taken across one.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["document_ids_from_cu_seqlens", "same_document"]


def document_ids_from_cu_seqlens(
    cu_seqlens: Sequence[Sequence[int]] | Sequence[torch.Tensor], seq_len: int
) -> torch.Tensor:
    """[batch, seq_len] int64 document indices from one ``cu_seqlens`` per row.

    Positions past a row's last boundary (padding) form one more document of their own,
    so they never mix with real text.
    """
    ends = [torch.as_tensor(bounds, dtype=torch.int64)[1:] for bounds in cu_seqlens]
    width = max((len(e) for e in ends), default=0)
    # One batched search over end tables padded with seq_len: per-row calls cost ~100x more.
    table = torch.full((len(ends), width), seq_len, dtype=torch.int64)
    for row, row_ends in enumerate(ends):
        table[row, : len(row_ends)] = row_ends
    positions = torch.arange(seq_len, dtype=torch.int64).expand(len(ends), seq_len)
    return torch.searchsorted(table, positions.contiguous(), right=True)


def same_document(document_ids: torch.Tensor, shift: int) -> torch.Tensor:
    """[batch, seq - shift] bool: position i and position i + shift are in one document."""
    return document_ids[:, :-shift] == document_ids[:, shift:]
