"""Causal attention over packed documents, in memory that grows with the sequence, not its square.

Packed documents must not see each other: a query attends to the keys of its own
document, up to itself. Written as one SDPA call that takes a boolean mask, that
mask is [S, S] per row: 1 GiB a row at 32k tokens, 1 TiB at 1M. Here the
attention is cut into blocks that need no mask at all, each one call of the
fused CPU kernel (``aten._scaled_dot_product_flash_attention_for_cpu``, which
also takes grouped K/V heads), and the blocks of one query row are merged
through their log-sum-exps, as ring attention merges its steps:

* a **diagonal** block: the queries and keys of one document over the same
  positions, causal (``is_causal``, square);
* a **past** block: the same queries against the earlier part of their
  document, which every one of them sees whole (no mask).

The queries may be any runs of positions of the sequence (context parallelism
gives a rank two chunks of it) while the keys cover the whole sequence. The
backward pass runs the kernel's own backward on each block with the merged
output and log-sum-exp, which is exactly the gradient of the merged attention
(the softmax of a block is its scores minus the row's whole log-sum-exp).

Peak memory is the kernel's own tiles plus one block's output: O(S) per head.
Equal to SDPA with the block-diagonal causal mask up to float rounding
(``tests/test_kernels_document_attention.py``).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["AttentionBlock", "QueryRun", "attention_blocks", "document_attention"]

_FORWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


@dataclass(frozen=True)
class QueryRun:
    """``length`` query rows from local row ``local`` on, at sequence positions ``start`` on."""

    local: int
    start: int
    length: int


@dataclass(frozen=True)
class AttentionBlock:
    """One mask-free attention call: query rows ``q`` against key rows ``k`` of batch row
    ``row`` (None: every row), causal when both cover the same positions."""

    row: int | None
    q: slice
    k: slice
    causal: bool


def _document_spans(document_ids: torch.Tensor | None, rows: int, length: int) -> list[list[int]]:
    """Per batch row, the positions where a document starts, and the sequence length last."""
    if document_ids is None:
        return [[0, length]] * rows
    changes = (document_ids[:, 1:] != document_ids[:, :-1]).nonzero().tolist()
    starts: list[list[int]] = [[0] for _ in range(rows)]
    for row, position in changes:
        starts[row].append(position + 1)
    return [[*row_starts, length] for row_starts in starts]


def attention_blocks(
    runs: list[QueryRun], document_ids: torch.Tensor | None, rows: int, length: int
) -> list[AttentionBlock]:
    """The blocks of causal attention for queries at ``runs`` over keys at every position of
    a ``length``-long sequence, documents kept apart (``document_ids`` [rows, length]; None:
    one document per row, and the blocks serve every row at once)."""
    spans = _document_spans(document_ids, 1 if document_ids is None else rows, length)
    blocks = []
    for row, bounds in enumerate(spans):
        which = None if document_ids is None else row
        for doc_start, doc_end in itertools.pairwise(bounds):
            for run in runs:
                first, last = max(run.start, doc_start), min(run.start + run.length, doc_end)
                if first >= last:
                    continue
                q = slice(run.local + first - run.start, run.local + last - run.start)
                if first > doc_start:
                    blocks.append(AttentionBlock(which, q, slice(doc_start, first), False))
                blocks.append(AttentionBlock(which, q, slice(first, last), True))
    return blocks


def _rows(block: AttentionBlock) -> slice:
    return slice(None) if block.row is None else slice(block.row, block.row + 1)


class _BlockAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        blocks: list[AttentionBlock],
        scale: float | None,
    ) -> torch.Tensor:
        out = q.new_zeros(q.shape, dtype=torch.float32)
        lse = q.new_full(q.shape[:-1], float("-inf"), dtype=torch.float32)
        for block in blocks:
            rows = _rows(block)
            o, block_lse = _FORWARD(
                q[rows, :, block.q], k[rows, :, block.k], v[rows, :, block.k], 0.0,
                block.causal, scale=scale,
            )  # fmt: skip
            seen = lse[rows, :, block.q]
            merged = torch.logaddexp(seen, block_lse)
            kept = out[rows, :, block.q]
            kept.mul_(torch.exp(seen - merged)[..., None])
            kept.add_(o.float() * torch.exp(block_lse - merged)[..., None])
            lse[rows, :, block.q] = merged
        result = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, result, lse)
        ctx.blocks, ctx.scale = blocks, scale
        return result

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        grad = grad.contiguous()
        dq = torch.zeros_like(q, dtype=torch.float32)
        dk = torch.zeros_like(k, dtype=torch.float32)
        dv = torch.zeros_like(v, dtype=torch.float32)
        for block in ctx.blocks:
            rows, qs, ks = _rows(block), block.q, block.k
            gq, gk, gv = _BACKWARD(
                grad[rows, :, qs], q[rows, :, qs], k[rows, :, ks], v[rows, :, ks],
                out[rows, :, qs], lse[rows, :, qs], 0.0, block.causal, scale=ctx.scale,
            )  # fmt: skip
            dq[rows, :, qs] += gq
            dk[rows, :, ks] += gk
            dv[rows, :, ks] += gv
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def document_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    blocks: list[AttentionBlock],
    scale: float | None = None,
) -> torch.Tensor:
    """Attention of ``q`` [B, H, Sq, D] over ``k``, ``v`` [B, Hkv, S, D] (Hkv divides H) as
    the sum of ``blocks`` (:func:`attention_blocks`); on the CPU."""
    return _BlockAttention.apply(q.contiguous(), k.contiguous(), v.contiguous(), blocks, scale)
