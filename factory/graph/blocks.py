"""One residual block per layer of the model spec: ``x + mixer(norm(x))``.

There is no separate MLP sub-block: each pattern character is one whole
residual block, as in Megatron's hybrid model and the Hugging Face checkpoints
(``layers.{i}.norm``, ``layers.{i}.mixer.*``). The mixer comes from the layer
type registered for the symbol (``factory.layers``), so a new layer type needs
no change here. Every mixer is called as ``mixer(x, document_ids)``
(``factory.nn.packed_documents``); token-wise mixers ignore the second argument.
"""

from __future__ import annotations

import torch
from torch import nn

from factory.layers.model_spec import LayerSpec
from factory.nn.decoding import DecodingCache
from factory.nn.norms import RMSNorm
from factory.nn.outputs import RoutedOutput
from factory.schemas.model import ModelConfig

__all__ = ["Block"]


class Block(nn.Module):
    """Pre-norm residual block. ``forward`` returns the new hidden state and, for a routing
    mixer, its :class:`RoutedOutput`."""

    def __init__(self, cfg: ModelConfig, layer: LayerSpec) -> None:
        super().__init__()
        self.symbol = layer.symbol
        self.path = layer.prefix
        """The block's path in the graph (``backbone.layers.3``), which keys its router stats."""
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.mixer = layer.type.build(cfg)

    def forward(
        self, x: torch.Tensor, document_ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, RoutedOutput | None]:
        out = self.mixer(self.norm(x), document_ids)
        if isinstance(out, RoutedOutput):
            return x + out.y, out
        return x + out, None

    def decode(self, x: torch.Tensor, cache: DecodingCache) -> torch.Tensor:
        """The next positions ``x`` [B, T, d] after those in ``cache`` (incremental decoding,
        ``factory.nn.decoding``): the mixer's ``decode`` in place of its ``forward``."""
        out = self.mixer.decode(self.norm(x), cache)
        return x + (out.y if isinstance(out, RoutedOutput) else out)
