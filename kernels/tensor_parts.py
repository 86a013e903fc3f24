"""The whole tensor behind a local part: what a quantizer needs when a GEMM operand is split.

A recipe with per-tensor statistics (NVFP4's global amax, FP8 current and delayed
scaling's amax, MoR's per-tensor error) quantizes a tensor split over processes as
one process would only if every part sees the whole tensor's statistics, and
stochastic rounding repeats one process only if each part rounds with the random
numbers one process would have drawn for the same elements. The quantizers take a
:class:`TensorPart` that says how: :data:`WHOLE` (the tensor is all here, nothing
to combine) or a split one (``factory.precision.splits``, which reduces over the
tensor-parallel group). The kernels call it exactly where they take an amax, a sum
or random numbers, so the reduction happens in one place per statistic.
"""

from __future__ import annotations

from typing import Protocol

import torch

__all__ = ["WHOLE", "TensorPart"]


class TensorPart(Protocol):
    """The part of a ``[..., rows, cols]`` tensor this process holds."""

    def max(self, local: torch.Tensor) -> torch.Tensor:
        """The elementwise max of ``local`` over every part (each part's amax -> the whole's)."""
        ...

    def sum(self, local: torch.Tensor) -> torch.Tensor:
        """The elementwise sum of ``local`` over every part."""
        ...

    def uniform(self, shape: torch.Size, generator: torch.Generator | None) -> torch.Tensor:
        """U[0, 1) fp32 numbers for this part's elements, given its (padded) local ``shape``:
        the ones one process would draw from ``generator`` for the same elements."""
        ...


class _Whole:
    """A tensor held whole: its statistics are its own, its random numbers drawn in order."""

    def max(self, local: torch.Tensor) -> torch.Tensor:
        return local

    def sum(self, local: torch.Tensor) -> torch.Tensor:
        return local

    def uniform(self, shape: torch.Size, generator: torch.Generator | None) -> torch.Tensor:
        return torch.rand(shape, generator=generator, dtype=torch.float32)


WHOLE: TensorPart = _Whole()
