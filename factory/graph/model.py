"""The whole language model: embedding, the hybrid stack, final norm, head, and MTP.

``model(input_ids)`` returns the logits ``[B, S, V]``. MTP logits and the MoE
auxiliary loss ride along on that same tensor as ``logits.extras`` (a
:class:`ModelExtras`), so callers that only want logits never see them.
Parameter names match the Hugging Face NemotronH checkpoints
(``backbone.layers.{i}.mixer...``, ``lm_head``, ``mtp.layers.{j}...``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from factory.graph.blocks import Block
from factory.graph.moe import MoE
from factory.graph.mtp import MultiTokenPrediction
from factory.graph.norms import RMSNorm
from factory.schemas.model import ModelConfig

__all__ = ["Backbone", "HybridLM", "ModelExtras"]


@dataclass
class ModelExtras:
    """What a forward pass produces besides the main logits."""

    mtp_logits: list[torch.Tensor] = field(default_factory=list)
    """One [B, S, V] tensor per MTP depth; depth k at position i predicts token i+k+1."""
    aux_loss: torch.Tensor | None = None
    """Sum of the MoE layers' load-balancing losses (training mode only)."""
    hidden: torch.Tensor | None = None
    """The main stack's output before the final norm."""


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, symbol) for symbol in cfg.layout.main)
        self.norm_f = RMSNorm(cfg.hidden_size, cfg.norm_eps)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embeddings(input_ids)
        for layer in self.layers:
            hidden = layer(hidden)
        return hidden


class HybridLM(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.backbone = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.backbone.embeddings.weight
        self.mtp = MultiTokenPrediction(cfg) if cfg.mtp_depth else None

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.backbone(input_ids)
        logits = self.lm_head(self.backbone.norm_f(hidden))
        extras = ModelExtras(hidden=hidden)
        if self.mtp is not None:
            extras.mtp_logits = self.mtp(hidden, input_ids, self.backbone.embeddings, self.lm_head)
        if self.training:
            losses = [m.last_aux_loss for m in self.modules() if isinstance(m, MoE)]
            losses = [loss for loss in losses if loss is not None]
            extras.aux_loss = torch.stack(losses).sum() if losses else None
        logits.extras = extras  # type: ignore[attr-defined]
        return logits

    def update_expert_biases(self) -> None:
        """Apply the aux-loss-free expert-bias step in every MoE layer (call once per optimizer step)."""
        for module in self.modules():
            if isinstance(module, MoE):
                module.gate.update_expert_bias()
