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

__all__ = ["WHOLE", "TensorPart", "draw_uniform"]


class TensorPart(Protocol):
    """The part of a ``[..., rows, cols]`` tensor this process holds."""

    def max(self, local: torch.Tensor) -> torch.Tensor:
        """The elementwise max of ``local`` over every part (each part's amax -> the whole's)."""
        ...

    def sum(self, local: torch.Tensor) -> torch.Tensor:
        """The elementwise sum of ``local`` over every part."""
        ...

    def uniform(
        self, shape: torch.Size, generator: torch.Generator | None, device: torch.device
    ) -> torch.Tensor:
        """U[0, 1) fp32 numbers on ``device`` for this part's elements, given its (padded) local
        ``shape``: the ones one process would draw (:func:`draw_uniform`) for the same
        elements."""
        ...


class _Whole:
    """A tensor held whole: its statistics are its own, its random numbers drawn in order."""

    def max(self, local: torch.Tensor) -> torch.Tensor:
        return local

    def sum(self, local: torch.Tensor) -> torch.Tensor:
        return local

    def uniform(
        self, shape: torch.Size, generator: torch.Generator | None, device: torch.device
    ) -> torch.Tensor:
        return draw_uniform(shape, generator, device)


WHOLE: TensorPart = _Whole()


def draw_uniform(
    shape: torch.Size | list[int], generator: torch.Generator | None, device: torch.device
) -> torch.Tensor:
    """U[0, 1) fp32 numbers of ``shape`` on ``device``, from ``generator`` (a quantizer's CPU
    generator, whose state checkpoints carry).

    On CPU they are the generator's own draws. On an accelerator the generator gives one
    64-bit seed per call and the numbers are drawn there from it: drawn on the host and
    copied over, a GEMM operand's worth each time, they made the emulated NVFP4 step of
    a 1B model on an H100 outrun its 90 s benchmark budget (``BENCHMARKS.md``, gpu). A run
    stays reproducible and resumes bitwise on its kind of device; CPU and GPU runs round
    differently."""
    device = torch.device(device)
    if device.type == "cpu":
        return torch.rand(shape, generator=generator, dtype=torch.float32)
    seed = int(torch.randint(0, 2**62, (1,), generator=generator))
    local = torch.Generator(device=device).manual_seed(seed)
    return torch.rand(shape, generator=local, dtype=torch.float32, device=device)
