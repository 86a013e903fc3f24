"""Training micro-batches from built shards: deterministic, cycling, with loss masks.

Why not webdataset or Energon here: a CPU proxy trains on a few thousand
samples that fit in memory many times over, and comparisons between runs
(NVFP4 vs BF16) need every run to see exactly the same samples in exactly the
same order. So all samples are read once into two arrays and the order is a
seeded permutation per epoch; iterating again restarts the same stream.

:func:`build_shards` runs the data pipeline on a blueprint's recipe at the
blueprint's ``data.seq_len`` (a recipe packs at its own ``packing.seq_len``,
4096 for the shipped ones; a proxy trains at 256), so a proxy trains on the
real curated mixture.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from factory.data.shards import read_shard
from factory.schemas.blueprint import Blueprint

__all__ = ["MicroBatch", "MicroBatches", "build_shards", "read_samples"]


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch of packed sequences.

    ``input_ids`` [B, S] int64; ``loss_mask`` [B, S] bool with the packing
    convention: ``loss_mask[b, i]`` says token ``i`` is a training target, i.e.
    the prediction made at position ``i - 1`` counts (prompts and padding are
    0). :func:`factory.graph.loss.language_model_loss` takes both as they are
    and does the shift, also for the MTP depths.
    """

    input_ids: torch.Tensor
    loss_mask: torch.Tensor

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


def build_shards(blueprint: Blueprint, out: Path, workers: int = 1) -> Path:
    """Build ``blueprint.data.recipe`` into ``out`` packed at ``blueprint.data.seq_len``.

    Returns ``out``. The pipeline is resumable and deterministic, so calling
    this again on the same folder reuses the curated intermediates.
    """
    from factory.data.pipeline import build
    from factory.data.recipe_loading import load_recipe, with_seq_len

    build(
        with_seq_len(load_recipe(blueprint.data.recipe), blueprint.data.seq_len),
        out,
        workers=workers,
    )
    return out


def read_samples(directory: Path) -> tuple[np.ndarray, np.ndarray]:
    """All samples of a built folder as (tokens int64 [N, S], loss_mask bool [N, S]).

    Shards are read in the manifest's order (sorted file names without one),
    samples in shard order: the same folder always gives the same arrays.
    """
    manifest = directory / "manifest.json"
    if manifest.is_file():
        names = [s["name"] for s in json.loads(manifest.read_text())["shards"]]
        paths = [directory / name for name in names]
    else:
        paths = sorted((directory / "shards").glob("*.tar"))
    samples = [sample for path in paths for sample in read_shard(path)]
    if not samples:
        raise ValueError(f"no samples in {directory}")
    tokens = np.stack([s.tokens for s in samples]).astype(np.int64)
    mask = np.stack([s.loss_mask for s in samples]).astype(bool)
    return tokens, mask


class MicroBatches:
    """An endless, reproducible stream of micro-batches over in-memory samples.

    Epoch ``e`` visits the samples in ``permutation(seed, e)`` order (or in
    stored order with ``shuffle=False``); micro-batches run across epoch
    boundaries, so the stream never drops or repeats a sample within an epoch.
    Every ``iter()`` starts the same stream from the beginning.
    """

    def __init__(
        self,
        tokens: np.ndarray,
        loss_mask: np.ndarray,
        micro_batch_size: int,
        seed: int = 0,
        shuffle: bool = True,
    ) -> None:
        if tokens.shape != loss_mask.shape or tokens.ndim != 2:
            raise ValueError(f"tokens {tokens.shape} and mask {loss_mask.shape} must be [N, S]")
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
        self.tokens = torch.from_numpy(np.ascontiguousarray(tokens, dtype=np.int64))
        self.loss_mask = torch.from_numpy(np.ascontiguousarray(loss_mask, dtype=bool))
        self.micro_batch_size = micro_batch_size
        self.seed = seed
        self.shuffle = shuffle

    @classmethod
    def from_directory(
        cls, directory: Path, micro_batch_size: int, seed: int = 0, shuffle: bool = True
    ) -> MicroBatches:
        tokens, mask = read_samples(directory)
        return cls(tokens, mask, micro_batch_size, seed, shuffle)

    @property
    def num_samples(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def seq_len(self) -> int:
        return int(self.tokens.shape[1])

    def _order(self) -> Iterator[int]:
        epoch = 0
        while True:
            if self.shuffle:
                rng = np.random.default_rng([self.seed, epoch])
                order = rng.permutation(self.num_samples)
            else:
                order = np.arange(self.num_samples)
            yield from (int(i) for i in order)
            epoch += 1

    def __iter__(self) -> Iterator[MicroBatch]:
        order = self._order()
        while True:
            index = torch.tensor([next(order) for _ in range(self.micro_batch_size)])
            yield MicroBatch(self.tokens[index], self.loss_mask[index])
