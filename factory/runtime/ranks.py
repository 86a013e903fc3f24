"""What the training loop asks of the other processes, and the answers of a single process.

The loop, the step and the checkpointer talk to the other ranks only through
:class:`Ranks`: sums over the data-parallel group (token counts, losses), sums
over the ranks that route distinct tokens (expert loads, for the expert-bias
step and MaxVio), the global gradient norm, and agreement on decisions. A
single process answers with the identity (:class:`SingleProcess`);
``factory.distributed.ranks.DistributedRanks`` answers over torch.distributed.
Every rank asks the same questions in the same order, so the collectives match.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

import torch
from torch import nn

__all__ = ["Ranks", "SingleProcess"]


class Ranks(Protocol):
    rank: int
    """Global rank of this process (0 on one process)."""
    world_size: int
    data_rank: int
    """Index of this rank's data-parallel replica: which micro-batches it reads."""
    data_size: int
    """Data-parallel replicas: the global batch is split among them."""

    @property
    def is_main(self) -> bool:
        """Rank 0: writes meta.json, metrics.jsonl and the progress display."""

    def sum_over_data(self, value: torch.Tensor) -> torch.Tensor:
        """``value`` summed over the data-parallel replicas (losses, token counts)."""

    def mean_over_data(self, values: dict[str, float]) -> dict[str, float]:
        """Per-layer statistics averaged over the data-parallel replicas, and known for every
        layer on every rank."""

    def sum_over_routing(self, loads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Per-layer expert loads summed over every rank that routed distinct tokens, and
        known for every layer on every rank (pipeline stages hold different layers)."""

    def grad_norm(self, params: Iterable[nn.Parameter]) -> torch.Tensor:
        """The L2 norm of all gradients of the whole model, whatever holds which shard."""

    def agree(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank (decisions every rank must take together)."""

    def barrier(self) -> None: ...


class SingleProcess:
    """One process holds everything: every question answers itself."""

    rank = 0
    world_size = 1
    data_rank = 0
    data_size = 1

    @property
    def is_main(self) -> bool:
        return True

    def sum_over_data(self, value: torch.Tensor) -> torch.Tensor:
        return value

    def mean_over_data(self, values: dict[str, float]) -> dict[str, float]:
        return values

    def sum_over_routing(self, loads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return loads

    def grad_norm(self, params: Iterable[nn.Parameter]) -> torch.Tensor:
        grads = [p.grad for p in params if p.grad is not None]
        return nn.utils.get_total_norm(grads) if grads else torch.zeros(())

    def agree(self, value: Any) -> Any:
        return value

    def barrier(self) -> None:
        return None
