"""Multi-token prediction, DeepSeek-V3 style.

Depth k predicts token t+k+1 from ``eh_proj(concat[enorm(emb(t+k)), hnorm(h))])``,
where h is the previous depth's output (the main stack's, before its final
norm, at depth 1), followed by the inner pattern's blocks, a final norm and the
shared output head.

The module tree mirrors the checkpoints: ``mtp.layers.{j}`` with
``j = block * len(pattern) + inner``; ``enorm``, ``hnorm`` and ``eh_proj``
hang off the block's first layer and ``final_layernorm`` off its last. In
repeated mode one stored block serves every depth (shared weights).
"""

from __future__ import annotations

import torch
from torch import nn

from factory.graph.blocks import Block
from factory.graph.norms import RMSNorm
from factory.schemas.model import ModelConfig

__all__ = ["MTPLayer", "MultiTokenPrediction"]


class MTPLayer(Block):
    def __init__(self, cfg: ModelConfig, symbol: str, first: bool, last: bool) -> None:
        super().__init__(cfg, symbol)
        d = cfg.hidden_size
        if first:
            self.enorm = RMSNorm(d, cfg.norm_eps)
            self.hnorm = RMSNorm(d, cfg.norm_eps)
            self.eh_proj = nn.Linear(2 * d, d, bias=False)
        if last:
            self.final_layernorm = RMSNorm(d, cfg.norm_eps)


class MultiTokenPrediction(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.depth = cfg.mtp_depth
        self.pattern = cfg.mtp_pattern
        self.blocks = cfg.mtp_stored_blocks
        size = len(self.pattern)
        self.layers = nn.ModuleList(
            MTPLayer(cfg, symbol, first=i == 0, last=i == size - 1)
            for _ in range(self.blocks)
            for i, symbol in enumerate(self.pattern)
        )

    def forward(
        self, hidden: torch.Tensor, input_ids: torch.Tensor, embed: nn.Embedding, head: nn.Module
    ) -> list[torch.Tensor]:
        """Logits per depth; depth k's position i predicts token i+k+1 (the last k+1 have no label)."""
        size = len(self.pattern)
        logits = []
        ids = input_ids
        for depth in range(self.depth):
            block = 0 if self.blocks == 1 else depth
            layers = self.layers[block * size : (block + 1) * size]
            # Shift the tokens one more step left; the wrapped-around tail is never a label.
            ids = torch.roll(ids, shifts=-1, dims=1)
            first = layers[0]
            hidden = first.eh_proj(torch.cat([first.enorm(embed(ids)), first.hnorm(hidden)], -1))
            for layer in layers:
                hidden = layer(hidden)
            logits.append(head(layers[-1].final_layernorm(hidden)))
        return logits
