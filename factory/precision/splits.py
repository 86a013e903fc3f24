"""How a quantized GEMM's operands lie across a tensor-parallel group, and how each rank's part
gets the whole tensor's statistics (``docs/distributed.md``, 'Quantized linears under TP').

A linear ``y = x Wᵀ`` has three dimensions: the tokens (M), its output features (N)
and its input features (K). Under tensor parallelism each is whole on every rank or
split over the group: a column linear splits N, a row linear K, and a linear that
sees only this rank's share of the sequence (or every rank's, gathered in another
order) has its tokens split (or permuted). Each operand of the three GEMMs is a
matrix over two of them, in this orientation::

    x [M, K]   W [N, K]   dy [M, N]   Wᵀ [K, N]   dyᵀ [N, M]   xᵀ [K, M]

:meth:`GemmSplit.part` gives the quantizer the :class:`~factory.kernels.tensor_parts.TensorPart`
of one operand: whole on every rank (nothing to combine), or split, whose amax
and sums are all-reduced over the group and whose stochastic-rounding numbers are
drawn for the whole operand, in one process's order, and indexed by the positions
this rank holds. Every rank of the group then rounds each element as one process
would: the same codes and scales, as long as each rank holds whole blocks
(``factory.checks`` refuses splits that cut one).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist

from factory.kernels.tensor_parts import WHOLE, TensorPart, draw_uniform

__all__ = ["WHOLE_GEMM", "Axis", "GemmSplit"]

Dim = Literal["tokens", "out", "in"]


@dataclass(frozen=True)
class Axis:
    """A GEMM dimension this rank holds part (or a reordering) of: ``size`` elements in all,
    this rank's at ``positions`` (the one-process index of each local element, in local
    order)."""

    size: int
    positions: torch.Tensor


@dataclass(frozen=True)
class GemmSplit:
    """Where a quantized GEMM's dimensions lie over ``group``; None: whole on every rank."""

    group: dist.ProcessGroup | None = None
    tokens: Axis | None = None
    out_features: Axis | None = None
    in_features: Axis | None = None

    def part(self, rows: Dim, cols: Dim) -> TensorPart:
        """The part of the operand whose rows run along ``rows`` and columns along ``cols``."""
        axes = {"tokens": self.tokens, "out": self.out_features, "in": self.in_features}
        row_axis, col_axis = axes[rows], axes[cols]
        if self.group is None or (row_axis is None and col_axis is None):
            return WHOLE
        return _SplitPart(self.group, row_axis, col_axis)


WHOLE_GEMM = GemmSplit()
"""One process, or a GEMM every rank computes whole."""


class _SplitPart:
    """A ``[..., rows, cols]`` operand split over ``group`` along its rows, columns or both."""

    def __init__(self, group: dist.ProcessGroup, rows: Axis | None, cols: Axis | None) -> None:
        self.group, self.rows, self.cols = group, rows, cols

    def max(self, local: torch.Tensor) -> torch.Tensor:
        return self._all_reduce(local, dist.ReduceOp.MAX)

    def sum(self, local: torch.Tensor) -> torch.Tensor:
        return self._all_reduce(local, dist.ReduceOp.SUM)

    def _all_reduce(self, local: torch.Tensor, op: dist.ReduceOp) -> torch.Tensor:
        whole = local.detach().clone()  # the caller's tensor stays this rank's own
        dist.all_reduce(whole, op=op, group=self.group)
        return whole

    def uniform(
        self, shape: torch.Size, generator: torch.Generator | None, device: torch.device
    ) -> torch.Tensor:
        """Draw the whole operand's numbers as one process would, then keep this rank's.

        Every rank draws all of them, so the generators of a group stay in step (they
        start alike: one seed per module). Split dims hold whole blocks, so a rank's
        padded extent is its share (checked); the other dims pad as one process does."""
        axes = ((-2, self.rows), (-1, self.cols))
        whole_shape = list(shape)
        for dim, axis in axes:
            if axis is not None:
                if shape[dim] != len(axis.positions):
                    raise ValueError(
                        f"a quantized operand's split dim has {len(axis.positions)} elements, "
                        f"padded to {shape[dim]}: a split must hold whole blocks"
                    )
                whole_shape[dim] = axis.size
        numbers = draw_uniform(whole_shape, generator, device)
        for dim, axis in axes:
            if axis is not None:
                numbers = numbers.index_select(dim, axis.positions.to(numbers.device))
        return numbers
