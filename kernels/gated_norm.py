"""Which implementation runs the Mamba mixer's gated group RMSNorm, and why.

CUDA tensors go to mamba_ssm's Triton ``rmsnorm_fn`` (``ops.triton.layernorm_gated``, loaded
by ``factory.kernels.mamba_ssm_triton``) with ``norm_before_gate=False`` and the group size
of ``factory.nn.norms.GatedGroupRMSNorm``: ``rmsnorm_group(y * silu(z)) * weight``, the gate,
the norm and the weight in one pass forward and one backward, as Megatron-Core's Mamba mixer
runs it. Everything else takes the module's PyTorch path, the reference.

The one difference is where the result rounds: the kernel multiplies the weight in fp32 and
rounds once to y's dtype; the reference (transformers' NemotronH) rounds the normalised value
to y's dtype, then multiplies the weight in the promoted dtype. In fp32 the two agree to
rounding; in bf16 they can differ in the last bit.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from factory.kernels.choice import KernelChoice
from factory.kernels.mamba_ssm_triton import serves, triton_module, unavailable

__all__ = ["gated_norm_kernel", "triton_gated_rmsnorm"]

NORM_MODULE = "ops.triton.layernorm_gated"
OP = "gated norm"
REFERENCE = "PyTorch"
TRITON = "mamba_ssm Triton (rmsnorm_fn)"

GatedNorm = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int, float], torch.Tensor]


@functools.cache
def _kernel() -> GatedNorm | None:
    module = triton_module(NORM_MODULE)
    if module is None:
        return None
    rmsnorm_fn = module.rmsnorm_fn

    @torch.compiler.disable  # a graph break: the wrapper switches CUDA devices
    def gated_rmsnorm(
        y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, groups: int, eps: float
    ) -> torch.Tensor:
        group_size = y.shape[-1] // groups
        return rmsnorm_fn(y, weight, None, z=z, eps=eps, group_size=group_size,
                          norm_before_gate=False)  # fmt: skip

    return gated_rmsnorm


def _choose(device: torch.device | str) -> tuple[GatedNorm | None, str | None]:
    """(the kernel, None) where it serves ``device``; (None, why) where it should and cannot;
    (None, None) where the PyTorch path is the choice (CPU)."""
    if not serves(device):
        return None, None
    kernel = _kernel()
    return (kernel, None) if kernel is not None else (None, unavailable(NORM_MODULE))


def triton_gated_rmsnorm(y: torch.Tensor) -> GatedNorm | None:
    """The fused norm for ``y`` (``norm(y, z, weight, groups, eps)``), None for the PyTorch path."""
    return _choose(y.device)[0]


def gated_norm_kernel(device: str) -> KernelChoice:
    """Which implementation the gated norm runs on ``device`` (the test the dispatch makes)."""
    kernel, why = _choose(device)
    return KernelChoice(OP, REFERENCE if kernel is None else TRITON, why)
