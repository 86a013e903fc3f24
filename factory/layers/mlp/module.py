"""The dense MLP (``-`` layers), also used as the MoE shared expert."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from factory.kernels.moe_dispatch import relu_squared
from factory.schemas.model import ModelConfig

__all__ = ["MLP", "activate", "build"]


def activate(h: torch.Tensor, activation: str, gate: torch.Tensor | None = None) -> torch.Tensor:
    """relu2: relu(h)^2 (Nemotron's non-gated squared ReLU); swiglu: silu(gate) * h."""
    if activation == "relu2":
        return relu_squared(h)
    if activation == "swiglu":
        assert gate is not None, "swiglu needs the gate projection"
        return F.silu(gate) * h
    raise ValueError(f"unknown activation {activation!r}")


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
        return self.down_proj(activate(self.up_proj(x), self.activation, gate))


def build(model: ModelConfig) -> MLP:
    """The ``-`` mixer of ``model`` (``LayerType.build``)."""
    cfg = model.mlp
    return MLP(model.hidden_size, cfg.intermediate_size, cfg.activation, cfg.bias)
