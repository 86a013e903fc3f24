"""Context parallelism's split of a sequence: which positions a rank holds, and the exchanges.

A sequence of S positions is cut into ``2 * cp`` equal chunks; rank ``r`` of the
context-parallel group holds chunks ``r`` and ``2 * cp - 1 - r`` (Megatron-Core's
load balancing, "head-tail": under a causal mask the early chunks cost little,
so every rank gets one cheap and one dear chunk). Its local rows are those two
chunks in that order.

The layers that mix positions exchange over the group, each as its layer type
says (``LayerType.context_parallel``): attention gathers every rank's keys and
values into the whole sequence (:meth:`SequenceSplit.gather`), Mamba trades
sequence shards for head shards and back (:meth:`SequenceSplit.to_heads`,
:meth:`SequenceSplit.to_sequence`). Every exchange is an autograd-aware
collective (``torch.distributed._functional_collectives``): an all-gather's
gradient is a reduce-scatter, an all-to-all's the reverse all-to-all.
"""

from __future__ import annotations

from functools import lru_cache

import torch
import torch.distributed as dist
from torch.distributed import _functional_collectives as funcol

from factory.kernels.document_attention import QueryRun

__all__ = ["SequenceSplit", "chunk_positions"]


@lru_cache(maxsize=64)
def chunk_positions(length: int, size: int, rank: int) -> tuple[int, ...]:
    """The positions rank ``rank`` of ``size`` holds, in its local order."""
    if length % (2 * size):
        raise ValueError(
            f"a sequence of {length} positions does not split into 2 * cp = {2 * size} chunks"
        )
    chunk = length // (2 * size)
    first, second = rank * chunk, (2 * size - 1 - rank) * chunk
    return (*range(first, first + chunk), *range(second, second + chunk))


class SequenceSplit:
    """This rank's share of every sequence over the context-parallel ``group``."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)

    def positions(self, length: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """The global positions of this rank's rows of a ``length``-long sequence."""
        return torch.tensor(chunk_positions(length, self.size, self.rank), device=device)

    def runs(self, length: int) -> list[QueryRun]:
        """This rank's rows as runs of consecutive positions (its two chunks)."""
        chunk = length // (2 * self.size)
        second = (2 * self.size - 1 - self.rank) * chunk
        return [QueryRun(0, self.rank * chunk, chunk), QueryRun(chunk, second, chunk)]

    def _rank_order(self, length: int, device: torch.device) -> torch.Tensor:
        """The natural index of every position when the ranks' rows are laid end to end."""
        order = [p for r in range(self.size) for p in chunk_positions(length, self.size, r)]
        return torch.tensor(order, device=device).argsort()

    def gather(self, local: torch.Tensor, dim: int) -> torch.Tensor:
        """Every rank's rows of ``local`` along ``dim``, as the whole sequence in order."""
        leading = local.movedim(dim, 0).contiguous()  # the collective gathers along dim 0
        stacked = funcol.all_gather_single_autograd(leading, 0, self.group)
        whole = stacked.index_select(0, self._rank_order(stacked.shape[0], local.device))
        return whole.movedim(0, dim)

    def to_heads(self, local: torch.Tensor) -> torch.Tensor:
        """[cp, B, L, C] (piece ``j`` for rank ``j``) -> [B, S, C]: this rank's piece of every
        rank's rows, as the whole sequence in order."""
        size, b, length, channels = local.shape
        received = funcol.all_to_all_single_autograd(
            local.contiguous().view(size * b * length, channels), None, None, self.group
        )
        rows = received.view(size, b, length, channels).permute(1, 0, 2, 3)
        whole = rows.reshape(b, size * length, channels)
        return whole.index_select(1, self._rank_order(size * length, local.device))

    def to_sequence(self, whole: torch.Tensor) -> torch.Tensor:
        """[B, S, C] in order -> [B, L, cp * C]: every rank's channels for this rank's rows,
        rank 0's first (the reverse of :meth:`to_heads`)."""
        b, length, channels = whole.shape
        order = self._rank_order(length, whole.device).argsort()  # rank order, in positions
        pieces = whole.index_select(1, order).view(b, self.size, length // self.size, channels)
        send = pieces.permute(1, 0, 2, 3).contiguous().view(-1, channels)
        received = funcol.all_to_all_single_autograd(send, None, None, self.group)
        local = received.view(self.size, b, length // self.size, channels)
        return local.permute(1, 2, 0, 3).reshape(b, length // self.size, self.size * channels)
