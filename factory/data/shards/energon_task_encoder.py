"""Energon sample, batch, cooker and task encoder for our packed shards.

This module imports megatron-energon and torch at the top: it is for Energon
users only; import it where megatron-energon is installed and pass
:func:`energon_task_encoder` to Energon's loaders.

Our ``dataset.yaml`` is Energon's crude form (see :mod:`factory.data.shards.energon_metadata`),
so a sample reaches the task encoder as a dict of decoded parts:
``tokens.npy`` (int32 [S]), ``loss_mask.npy`` (uint8 [S]), ``cu_seqlens.npy``
(int32 [n_docs + 1], document boundaries inside the packed row) and ``json``
(``{"doc_keys": [...]}``), named as ``sample_format``'s field table names them. The
cooker turns that into :class:`PackedTokensSample`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from megatron.energon import (
    Batch,
    Cooker,
    DefaultTaskEncoder,
    Sample,
    basic_sample_keys,
    stateless,
)

from factory.data.shards.sample_format import CU_SEQLENS, DOC_KEYS, LOSS_MASK, TOKENS

__all__ = [
    "PACKED_COOKER",
    "PackedTaskEncoder",
    "PackedTokensBatch",
    "PackedTokensSample",
    "cook_packed_sample",
    "energon_task_encoder",
]


@dataclass
class PackedTokensSample(Sample):
    """One packed row: the same tokens and mask as ``factory.data.shards.shard_reader.read_samples``."""

    tokens: torch.Tensor
    """int64 [S]."""
    loss_mask: torch.Tensor
    """bool [S]: True where the token is trained on."""
    cu_seqlens: torch.Tensor
    """int32 [n_docs + 1]: document starts within the row, then the number of real tokens
    (padding, if any, lies beyond it)."""
    doc_keys: list[str]


@dataclass
class PackedTokensBatch(Batch):
    """A micro-batch in the layout of Megatron's packed (THD) attention."""

    tokens: torch.Tensor
    """int64 [B, S]."""
    loss_mask: torch.Tensor
    """bool [B, S]."""
    cu_seqlens: torch.Tensor
    """int32: segment boundaries over the flattened [B * S] tokens, from 0 to B * S.

    Each document is a segment; a row's padding is one more segment (its loss
    mask is False), because packed attention kernels expect the segments to
    cover every token."""
    doc_keys: list[list[str]]


# Stateless: Energon restores a checkpointed loader by re-cooking samples from
# their keys alone, so the cooker may depend on nothing but the crude sample.
@stateless
def cook_packed_sample(crude: dict) -> PackedTokensSample:
    """Turn one crude sample of our shards into a :class:`PackedTokensSample`."""
    return PackedTokensSample(
        **basic_sample_keys(crude),
        tokens=torch.from_numpy(np.asarray(crude[TOKENS.suffix], dtype=np.int64)),
        loss_mask=torch.from_numpy(np.asarray(crude[LOSS_MASK.suffix]).astype(bool)),
        cu_seqlens=torch.from_numpy(np.asarray(crude[CU_SEQLENS.suffix], dtype=np.int32)),
        doc_keys=list(crude[DOC_KEYS.suffix][DOC_KEYS.attr]),
    )


PACKED_COOKER: Cooker = Cooker(cook_packed_sample)


def _flat_cu_seqlens(samples: list[PackedTokensSample]) -> torch.Tensor:
    """Concatenate per-row boundaries, row ``b`` shifted by ``b * S``; padding closes a row."""
    bounds = [0]
    offset = 0
    for sample in samples:
        bounds.extend(offset + int(b) for b in sample.cu_seqlens[1:])
        offset += int(sample.tokens.numel())
        if bounds[-1] < offset:
            bounds.append(offset)
    return torch.tensor(bounds, dtype=torch.int32)


class PackedTaskEncoder(DefaultTaskEncoder):
    """Cooks our crude samples and batches them as :class:`PackedTokensBatch`."""

    cookers = (PACKED_COOKER,)

    def batch(self, samples: list[PackedTokensSample]) -> PackedTokensBatch:  # type: ignore[override]
        if len({s.tokens.shape for s in samples}) > 1:
            raise ValueError("packed samples of one batch must share their length")
        return PackedTokensBatch.from_samples(
            samples,
            tokens=torch.stack([s.tokens for s in samples]),
            loss_mask=torch.stack([s.loss_mask for s in samples]),
            cu_seqlens=_flat_cu_seqlens(samples),
            doc_keys=[s.doc_keys for s in samples],
        )


def energon_task_encoder() -> PackedTaskEncoder:
    """A megatron-energon task encoder for our shards: it cooks each crude sample into a
    :class:`PackedTokensSample` (int64 tokens, bool loss mask, int32 ``cu_seqlens``) and
    batches them as :class:`PackedTokensBatch`."""
    return PackedTaskEncoder()
