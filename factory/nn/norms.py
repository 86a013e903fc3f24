"""RMSNorm and the Mamba mixer's gated, grouped RMSNorm.

Both compute in fp32 and multiply the weight in fp32 before casting back,
which is what the released checkpoints were trained with and what
transformers' NemotronH does; matching it keeps exported logits identical.
``F.rms_norm`` is x * rsqrt(mean(x^2) + eps) as NemotronH writes it out (the same
values), in a fused kernel with a fused backward: fewer passes than the ops one by one.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from factory.kernels.gated_norm import triton_gated_rmsnorm

__all__ = ["GatedGroupRMSNorm", "RMSNorm"]


class RMSNorm(nn.Module):
    def __init__(self, width: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = F.rms_norm(x.float(), x.shape[-1:], eps=self.eps)
        return (self.weight.float() * x).to(dtype)


class GatedGroupRMSNorm(nn.Module):
    """``RMSNorm_group(y * silu(z)) * w``: the gate is applied before the norm (norm_before_gate=False),
    and each of ``groups`` channel groups is normalised on its own, so the norm shards with TP.

    On CUDA mamba_ssm's fused Triton kernel computes it (``factory.kernels.gated_norm``: the
    same values, rounded once); this PyTorch path is the reference."""

    def __init__(self, width: int, groups: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.groups = groups
        self.eps = eps

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        fused = triton_gated_rmsnorm(y)
        if fused is not None:
            return fused(y, z, self.weight, self.groups, self.eps)
        dtype = y.dtype
        y = y.float() * F.silu(z.float())
        grouped = y.unflatten(-1, (self.groups, -1))
        grouped = F.rms_norm(grouped, grouped.shape[-1:], eps=self.eps)
        return self.weight * grouped.flatten(-2).to(dtype)
