"""Training micro-batches from built shards, and the shards of a blueprint's recipe.

:class:`MicroBatch` is what the training loop consumes; :func:`collate` stacks
samples read by the data package's one shard reader
(:mod:`factory.data.shards.shard_reader`: the manifest's list, checked, and
each shard's samples as zero-copy numpy views) into one.
:class:`factory.runtime.loader.ShardLoader` streams them in a resumable order.

:func:`build_shards` runs the data build on a blueprint's recipe at the
blueprint's ``data.seq_len`` (a recipe packs at its own ``packing.seq_len``,
4096 for the shipped ones; a proxy trains at 256), so a proxy trains on the
real curated mixture.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from factory.data.build_job import build
from factory.data.shards.shard_reader import Sample
from factory.nn.packed_documents import document_ids_from_cu_seqlens
from factory.schemas.blueprint import Blueprint

__all__ = ["MicroBatch", "build_shards", "collate"]


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch of packed sequences.

    ``input_ids`` [B, S] int64; ``loss_mask`` [B, S] bool with the packing
    convention: ``loss_mask[b, i]`` says token ``i`` is a training target, i.e.
    the prediction made at position ``i - 1`` counts (prompts and padding are
    0). :func:`factory.graph.loss.language_model_loss` takes both as they are
    and does the shift, also for the MTP depths. ``document_ids`` [B, S] int64
    (None where the source has no ``cu_seqlens``) is the packed document of
    every position, as the graph's mixers take it (``factory/nn/packed_documents.py``).
    """

    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    document_ids: torch.Tensor | None = None

    @property
    def targets(self) -> torch.Tensor:
        """[B, S-1]: the tokens the main head predicts at positions 0..S-2."""
        return self.input_ids[:, 1:]

    @property
    def target_mask(self) -> torch.Tensor:
        """[B, S-1]: which of :attr:`targets` count in the loss."""
        return self.loss_mask[:, 1:]

    @property
    def num_tokens(self) -> int:
        """Positions in the batch (padding included), what tokens-seen counts."""
        return int(self.input_ids.numel())


def collate(samples: Sequence[Sample]) -> MicroBatch:
    """Stack samples of one length into a :class:`MicroBatch` (copies: no view outlives it).

    Positions past a sample's last ``cu_seqlens`` entry (padding) are a
    document of their own, as :func:`document_ids_from_cu_seqlens` defines.
    """
    tokens = np.stack([s.tokens for s in samples]).astype(np.int64)
    mask = np.stack([s.loss_mask for s in samples]).astype(bool)
    # astype copies: torch warns on (and must never write through) read-only shard views
    bounds = [s.cu_seqlens.astype(np.int64) for s in samples]
    documents = document_ids_from_cu_seqlens(bounds, tokens.shape[1])
    return MicroBatch(torch.from_numpy(tokens), torch.from_numpy(mask), documents)


def build_shards(blueprint: Blueprint, out: Path, workers: int = 1) -> Path:
    """Build ``blueprint.data.recipe`` into ``out`` packed at ``blueprint.data.seq_len``.

    Returns ``out``. The pipeline is resumable and deterministic, so calling
    this again on the same folder reuses the curated intermediates.
    """
    build(blueprint.data.recipe, out, workers=workers, seq_len=blueprint.data.seq_len)
    return out
