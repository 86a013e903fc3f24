"""Multi-token prediction, DeepSeek-V3 style (the block is described in ``factory.layers.mtp``).

Depth k predicts token t+k+1 from ``eh_proj(concat[enorm(emb(t+k)), hnorm(h))])``,
where h is the previous depth's output (the main stack's, before its final
norm, at depth 1), followed by the inner pattern's blocks, a final norm and the
shared output head. In repeated mode one stored block serves every depth.
"""

from __future__ import annotations

import torch
from torch import nn

from factory.graph.blocks import Block
from factory.layers.model_spec import LayerSpec, ModelSpec
from factory.nn.decoding import DecodingCache
from factory.nn.norms import RMSNorm
from factory.nn.outputs import collect_routing
from factory.schemas.model import ModelConfig

__all__ = ["MTPLayer", "MultiTokenPrediction"]


class MTPLayer(Block):
    def __init__(self, cfg: ModelConfig, layer: LayerSpec, first: bool, last: bool) -> None:
        super().__init__(cfg, layer)
        d = cfg.hidden_size
        if first:
            self.enorm = RMSNorm(d, cfg.norm_eps)
            self.hnorm = RMSNorm(d, cfg.norm_eps)
            self.eh_proj = nn.Linear(2 * d, d, bias=False)
        if last:
            self.final_layernorm = RMSNorm(d, cfg.norm_eps)


class MultiTokenPrediction(nn.Module):
    def __init__(self, cfg: ModelConfig, spec: ModelSpec) -> None:
        super().__init__()
        self.depth = cfg.mtp_depth
        self.blocks = cfg.mtp_stored_blocks
        size = len(cfg.mtp_pattern)
        self.layers = nn.ModuleList(
            MTPLayer(cfg, layer, first=j % size == 0, last=j % size == size - 1)
            for j, layer in enumerate(spec.mtp_layers)
        )

    def forward(
        self,
        hidden: torch.Tensor,
        input_ids: torch.Tensor,
        embed: nn.Embedding,
        head: nn.Module | None,
        routed: dict[str, torch.Tensor],
        aux: list[torch.Tensor],
        document_ids: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, ...]:
        """Logits per depth; depth k's position i predicts token i+k+1 (the last k+1 have no
        label). Without ``head``, each depth's head input (its final norm's output), for the
        fused loss. Routing statistics of the inner MoE layers are added to ``routed``/``aux``.
        ``positions``: the sequence positions of ``hidden``'s rows (context parallelism;
        ``input_ids`` is then the whole sequence)."""
        logits = []
        ids = input_ids
        for depth in range(self.depth):
            layers = self.depth_layers(depth)
            # Shift the tokens one more step left; the wrapped-around tail is never a label.
            ids = torch.roll(ids, shifts=-1, dims=1)
            rows = ids if positions is None else ids[:, positions]
            first = layers[0]
            hidden = first.eh_proj(torch.cat([first.enorm(embed(rows)), first.hnorm(hidden)], -1))
            for layer in layers:
                hidden, out = layer(hidden, document_ids)
                collect_routing(routed, aux, layer.path, out)
            normed = layers[-1].final_layernorm(hidden)
            logits.append(normed if head is None else head(normed))
        return tuple(logits)

    def depth_layers(self, depth: int) -> list[MTPLayer]:
        """The blocks that predict at ``depth`` (0-based): its own, or the one repeated block."""
        size = len(self.layers) // self.blocks
        block = 0 if self.blocks == 1 else depth
        return list(self.layers[block * size : (block + 1) * size])  # type: ignore[arg-type]

    def init_caches(
        self, depth: int, batch: int, capacity: int, device: torch.device, dtype: torch.dtype
    ) -> list[DecodingCache]:
        """Empty decoding caches of ``depth``'s blocks: each depth reads its own sequence of
        hidden states, so a repeated block keeps one cache per depth."""
        return [
            layer.mixer.init_cache(batch, capacity, device, dtype)
            for layer in self.depth_layers(depth)
        ]

    def decode(
        self,
        depth: int,
        hidden: torch.Tensor,
        next_ids: torch.Tensor,
        embed: nn.Embedding,
        caches: list[DecodingCache],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``depth`` over the next positions after those in ``caches``: ``hidden`` [B, T, d] is
        the previous depth's output there (the main stack's at depth 0), ``next_ids`` [B, T]
        the tokens ``depth + 1`` places later. -> (this depth's output, its final norm's,
        the head's input)."""
        layers = self.depth_layers(depth)
        first = layers[0]
        hidden = first.eh_proj(torch.cat([first.enorm(embed(next_ids)), first.hnorm(hidden)], -1))
        for layer, cache in zip(layers, caches, strict=True):
            hidden = layer.decode(hidden, cache)
        return hidden, layers[-1].final_layernorm(hidden)
