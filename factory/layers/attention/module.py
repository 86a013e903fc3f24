"""Causal grouped-query self-attention (the ``*`` layers).

Nemotron-H and Nemotron 3 use no position embedding here: the Mamba layers
carry position. RoPE is available for blueprints that ask for it.

Packed documents never see each other, and no [S, S] mask is built for that
(:func:`causal_attention`): on CUDA it is FlexAttention with a document block
mask, built once per step for every layer, in eager runs and for compiled
blocks alike, which take it as an input (``factory.kernels.flex_documents``); on the CPU, the reference,
the attention is cut into mask-free blocks along the documents
(``factory.kernels.document_attention``). One document per row, whole, is
SDPA's own causal path everywhere. ``torch.nn.attention.varlen`` (flash
attention over the documents) stays the option :data:`CUDA_DOCUMENT_KERNEL`
names, for where it measures faster.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Literal

import torch
from torch import nn
from torch.nn import functional as F

from factory.kernels.choice import KernelChoice
from factory.kernels.document_attention import QueryRun, attention_blocks, document_attention
from factory.kernels.flex_documents import document_mask, flex_document_attention, flex_unavailable
from factory.nn.decoding import DecodingCache
from factory.nn.sequence_split import SequenceSplit
from factory.schemas.model import AttentionConfig, ModelConfig

VARLEN_MODULE = "torch.nn.attention.varlen"
VARLEN_IMPORTABLE = importlib.util.find_spec(VARLEN_MODULE) is not None
"""Whether this torch has ``varlen_attn``: a submodule ``torch.nn.attention`` does not import,
so ``hasattr`` never saw it; torch 2.11 has none (seen on the H200, 2026-11-28). It is
imported where it runs: importing it loads torch's compiler (``torch._dynamo``), which
building a model must not (``tests/test_graph.py``)."""

__all__ = [
    "CUDA_DOCUMENT_KERNEL",
    "Attention",
    "KVCache",
    "apply_rope",
    "attention_kernel",
    "build",
    "causal_attention",
    "kernel_choices",
]

CUDA_DOCUMENT_KERNEL: Literal["flex", "varlen"] = "flex"
"""Attention over packed documents on CUDA. FlexAttention by default: on an H100 it measured
4.9x the forward and 2.3x the forward + backward of SDPA with the dense mask at 8k tokens
(issue 38), and it is the one path that serves eager runs, compiled blocks and context
parallelism's query runs alike. ``"varlen"`` (``torch.nn.attention.varlen``, whole sequences
in eager runs only) has not been timed against it yet: ``python -m benchmarks gpu``'s
attention section compares the two at Nano's head shapes, and decides."""

DocumentPath = Literal["blocks", "flex", "varlen", "masked"]
"""How :func:`causal_attention` computes attention over documents or query runs."""


def apply_rope(
    x: torch.Tensor, base: float, fraction: float, positions: torch.Tensor | None = None
) -> torch.Tensor:
    """Rotate the first ``fraction`` of each head's channels (rotate-half convention). x: [b, h,
    s, d]; ``positions`` [s] of its rows (None: 0 .. s-1)."""
    dim = int(x.shape[-1] * fraction) // 2 * 2
    if dim == 0:
        return x
    rotated, passed = x[..., :dim], x[..., dim:]
    inv_freq = 1.0 / base ** (torch.arange(0, dim, 2, device=x.device, dtype=torch.float32) / dim)
    if positions is None:
        positions = torch.arange(x.shape[-2], device=x.device)
    angles = positions.to(torch.float32)[:, None] * inv_freq
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
        self.sequence_split: SequenceSplit | None = None
        """Set by context parallelism: the rows are this rank's chunks of the sequence, and
        the keys and values of every rank's chunks are gathered (``kv_exchange``)."""

    def forward(self, x: torch.Tensor, document_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Causal attention; with ``document_ids`` a query sees only its own document's keys.
        Under context parallelism ``document_ids`` covers the whole sequence."""
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        split, positions, runs = self.sequence_split, None, None
        if split is not None:
            positions = split.positions(s * split.size, x.device)
            runs = split.runs(s * split.size)
        if self.rope is not None:
            q, k = apply_rope(q, *self.rope, positions), apply_rope(k, *self.rope, positions)
        if split is not None:
            k, v = split.gather(k, 2), split.gather(v, 2)
        out = causal_attention(q, k, v, document_ids, runs)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, self.heads * self.head_dim))

    def init_cache(
        self, batch: int, capacity: int, device: torch.device, dtype: torch.dtype
    ) -> KVCache:
        """An empty KV cache for ``batch`` sequences of up to ``capacity`` positions."""
        return KVCache(batch, self.kv_heads, self.head_dim, capacity, device, dtype)

    def decode(self, x: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """The next T positions ``x`` [B, T, d] after the cached ones: each attends to the cache
        and to the new positions up to itself; their keys and values join the cache."""
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        past = cache.length
        if self.rope is not None:
            positions = torch.arange(past, past + s, device=x.device)
            q, k = apply_rope(q, *self.rope, positions), apply_rope(k, *self.rope, positions)
        keys, values = cache.append(k, v)
        if past == 0:  # the prompt: the same causal SDPA as the full forward
            out = F.scaled_dot_product_attention(q, keys, values, is_causal=True, enable_gqa=True)
        else:
            # Query t (position past + t) sees keys 0 .. past + t; one query sees them all.
            mask = None
            if s > 1:
                rows = torch.arange(past, past + s, device=x.device)
                mask = torch.arange(past + s, device=x.device)[None, :] <= rows[:, None]
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, self.heads * self.head_dim))


class KVCache(DecodingCache):
    """The keys and values of the positions decoded so far, [B, kv_heads, capacity, head_dim]
    each (grouped-query: the KV heads only), the first ``length`` positions filled."""

    def __init__(
        self,
        batch: int,
        kv_heads: int,
        head_dim: int,
        capacity: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.keys = torch.zeros(batch, kv_heads, capacity, head_dim, device=device, dtype=dtype)
        self.values = torch.zeros_like(self.keys)
        self.length = 0
        self.appended = 0
        """Positions the last step added (what :meth:`keep` may take back)."""

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Add ``k``, ``v`` [B, kv_heads, T, head_dim]; -> every position's keys and values."""
        start, end = self.length, self.length + k.shape[2]
        if end > self.keys.shape[2]:
            raise ValueError(f"the KV cache holds {self.keys.shape[2]} positions, not {end}")
        self.keys[:, :, start:end] = k
        self.values[:, :, start:end] = v
        self.length, self.appended = end, end - start
        return self.keys[:, :, :end], self.values[:, :, :end]

    def keep(self, count: int) -> None:
        """Keep the first ``count`` positions of the last step: the rest are overwritten later."""
        self.length -= self.appended - count
        self.appended = count


def causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    document_ids: torch.Tensor | None,
    runs: list[QueryRun] | None = None,
) -> torch.Tensor:
    """Causal attention of ``q`` [B, H, Sq, D] over ``k``, ``v`` [B, Hkv, S, D], each query
    seeing only keys of its own document (``document_ids`` [B, S]; None: one per row).
    ``runs`` place the query rows in the sequence (context parallelism: a rank's chunks);
    None: the queries are the whole sequence."""
    length = k.shape[2]
    whole = runs is None
    if whole and document_ids is None:
        # enable_gqa lets SDPA broadcast the KV heads instead of materialising repeats.
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    runs = runs or [QueryRun(0, 0, length)]
    path, _ = _document_path(q.device.type, torch.compiler.is_compiling(), whole)
    if path == "flex":
        mask = document_mask(document_ids, runs, q.shape[2], length, q.device)
        return flex_document_attention(q, k, v, mask)
    if path == "blocks":
        blocks = attention_blocks(runs, document_ids, q.shape[0], length)
        return document_attention(q, k, v, blocks)
    if path == "varlen" and document_ids is not None:
        return _varlen_documents(q, k, v, document_ids)
    return _masked(q, k, v, document_ids, runs)


def _document_path(device: str, compiling: bool, whole: bool) -> tuple[DocumentPath, str | None]:
    """The path of attention over documents (or query runs) on ``device``, inside a compiled
    graph or not, for queries that are the ``whole`` sequence or runs of it; and why a faster
    one was not taken (None on CPU, whose paths are the reference)."""
    if device == "cpu":
        # The blocks cut along the documents in Python (.tolist()); a graph takes the mask.
        return ("masked" if compiling else "blocks"), None
    reason = flex_unavailable(device) or ""
    if not reason and CUDA_DOCUMENT_KERNEL == "flex":
        return "flex", None
    varlen = device == "cuda" and VARLEN_IMPORTABLE
    if varlen and whole and not compiling:
        return "varlen", reason or None
    if not reason:
        return "flex", None  # varlen chosen, but it serves neither compiled graphs nor runs
    if varlen and not whole:
        reason += "; varlen_attn takes whole sequences, not context parallelism's query runs"
    elif varlen:
        reason += "; varlen_attn does not trace into a compiled block"
    elif device == "cuda":
        reason += "; this torch has no varlen_attn"
    return "masked", reason


_PATH_NAMES: dict[DocumentPath, str] = {
    "blocks": "SDPA per document block",
    "flex": "FlexAttention with a document block mask",
    "varlen": "varlen_attn (flash) over the documents",
    "masked": "SDPA with a dense mask",
}


def attention_kernel(device: str, compiling: bool = False, whole: bool = True) -> KernelChoice:
    """Which implementation :func:`causal_attention` runs over packed documents for tensors on
    ``device``, in eager runs or inside a compiled block (``compiling``)."""
    path, reason = _document_path(device, compiling, whole)
    op = "attention in compiled blocks" if compiling else "attention"
    return KernelChoice(op, _PATH_NAMES[path], reason)


def _varlen_documents(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, document_ids: torch.Tensor
) -> torch.Tensor:
    """Every document of every row as one sequence of ``varlen_attn`` (flash attention on
    CUDA): the batch's tokens packed row after row, documents cut at their boundaries."""
    b, h, s, d = q.shape
    flat = document_ids + torch.arange(b, device=q.device)[:, None] * (document_ids.max() + 1)
    starts = torch.ones(b * s, dtype=torch.bool, device=q.device)
    starts[1:] = flat.reshape(-1)[1:] != flat.reshape(-1)[:-1]
    cu = torch.cat([starts.nonzero().flatten(), torch.tensor([b * s], device=q.device)])
    cu = cu.to(torch.int32)
    longest = int((cu[1:] - cu[:-1]).max())
    packed = [t.transpose(1, 2).reshape(b * s, t.shape[1], d) for t in (q, k, v)]
    out = importlib.import_module(VARLEN_MODULE).varlen_attn(
        *packed, cu, cu, longest, longest, window_size=(-1, 0), enable_gqa=True
    )
    return out.reshape(b, s, h, d).transpose(1, 2)


def _masked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    document_ids: torch.Tensor | None,
    runs: list[QueryRun],
) -> torch.Tensor:
    """SDPA with an explicit [Sq, S] mask: for compiled blocks, and devices with neither path
    above."""
    positions = torch.cat([torch.arange(r.start, r.start + r.length) for r in runs])
    positions = positions.to(q.device)
    keys = torch.arange(k.shape[2], device=q.device)
    mask = keys[None, :] <= positions[:, None]
    if document_ids is not None:
        mask = mask & (document_ids[:, positions, None] == document_ids[:, None, :])
    mask = mask if mask.dim() == 3 else mask[None]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], enable_gqa=True)


def build(model: ModelConfig) -> Attention:
    """The ``*`` mixer of ``model`` (``LayerType.build``)."""
    rope = (model.rope_base, model.rope_fraction) if model.position_embedding == "rope" else None
    return Attention(model.hidden_size, model.attention, rope)


def kernel_choices(model: ModelConfig, device: str) -> list[KernelChoice]:
    """Attention's kernel for packed documents on ``device`` (:func:`causal_attention`), in
    eager runs and in compiled blocks (``training.compile``)."""
    return [attention_kernel(device), attention_kernel(device, compiling=True)]
