"""The dense MLP (``-`` layers), also used as the MoE shared expert."""

from __future__ import annotations

import torch
from torch import nn

from factory.kernels.choice import KernelChoice
from factory.kernels.moe_dispatch import activate
from factory.nn.decoding import StatelessCache
from factory.schemas.model import ModelConfig

__all__ = ["MLP", "build", "kernel_choices"]


class MLP(nn.Module):
    def __init__(self, width: int, hidden: int, activation: str, bias: bool) -> None:
        super().__init__()
        self.activation = activation
        self.up_proj = nn.Linear(width, hidden, bias=bias)
        self.gate_proj = nn.Linear(width, hidden, bias=bias) if activation == "swiglu" else None
        self.down_proj = nn.Linear(hidden, width, bias=bias)

    def forward(self, x: torch.Tensor, document_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Token-wise: ``document_ids`` changes nothing."""
        gate = self.gate_proj(x) if self.gate_proj is not None else None
        return self.down_proj(activate(self.up_proj(x), gate, self.activation))

    def init_cache(
        self, batch: int, capacity: int, device: torch.device, dtype: torch.dtype
    ) -> StatelessCache:
        """Token-wise: nothing to keep between decoding steps."""
        return StatelessCache()

    def decode(self, x: torch.Tensor, cache: StatelessCache) -> torch.Tensor:
        """The next positions: the same as :meth:`forward`, position by position."""
        return self(x)


def build(model: ModelConfig) -> MLP:
    """The ``-`` mixer of ``model`` (``LayerType.build``)."""
    cfg = model.mlp
    return MLP(model.hidden_size, cfg.intermediate_size, cfg.activation, cfg.bias)


def kernel_choices(model: ModelConfig, device: str) -> list[KernelChoice]:
    """The dense MLP is two GEMMs and an activation: the device's own matmul."""
    return [KernelChoice("mlp gemms", "torch.matmul")]
