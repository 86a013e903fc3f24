"""Causal grouped-query self-attention (the ``*`` layers).

Nemotron-H and Nemotron 3 use no position embedding here: the Mamba layers
carry position. RoPE is available for blueprints that ask for it.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from factory.schemas.model import AttentionConfig, ModelConfig

__all__ = ["Attention", "apply_rope", "build"]


def apply_rope(x: torch.Tensor, base: float, fraction: float) -> torch.Tensor:
    """Rotate the first ``fraction`` of each head's channels (rotate-half convention). x: [b, h, s, d]."""
    dim = int(x.shape[-1] * fraction) // 2 * 2
    if dim == 0:
        return x
    rotated, passed = x[..., :dim], x[..., dim:]
    inv_freq = 1.0 / base ** (torch.arange(0, dim, 2, device=x.device, dtype=torch.float32) / dim)
    angles = torch.arange(x.shape[-2], device=x.device, dtype=torch.float32)[:, None] * inv_freq
    cos = torch.cat([angles.cos(), angles.cos()], -1).to(x.dtype)
    sin = torch.cat([angles.sin(), angles.sin()], -1).to(x.dtype)
    half = dim // 2
    turned = torch.cat([-rotated[..., half:], rotated[..., :half]], -1)
    return torch.cat([rotated * cos + turned * sin, passed], -1)


class Attention(nn.Module):
    def __init__(
        self, width: int, cfg: AttentionConfig, rope: tuple[float, float] | None = None
    ) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.heads, cfg.kv_heads, cfg.head_dim
        self.rope = rope
        self.q_proj = nn.Linear(width, cfg.heads * cfg.head_dim, bias=cfg.bias)
        self.k_proj = nn.Linear(width, cfg.kv_heads * cfg.head_dim, bias=cfg.bias)
        self.v_proj = nn.Linear(width, cfg.kv_heads * cfg.head_dim, bias=cfg.bias)
        self.o_proj = nn.Linear(cfg.heads * cfg.head_dim, width, bias=cfg.bias)

    def forward(self, x: torch.Tensor, document_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Causal attention; with ``document_ids`` a query sees only its own document's keys
        (a block-diagonal causal mask through SDPA)."""
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        if self.rope is not None:
            q, k = apply_rope(q, *self.rope), apply_rope(k, *self.rope)
        # enable_gqa lets SDPA broadcast the KV heads instead of materialising repeats.
        if document_ids is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            causal = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
            same = document_ids[:, :, None] == document_ids[:, None, :]
            mask = (same & causal)[:, None]  # [b, 1, s, s]
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, self.heads * self.head_dim))


def build(model: ModelConfig) -> Attention:
    """The ``*`` mixer of ``model`` (``LayerType.build``)."""
    rope = (model.rope_base, model.rope_fraction) if model.position_embedding == "rope" else None
    return Attention(model.hidden_size, model.attention, rope)
