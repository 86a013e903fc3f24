"""Fused LM head and cross-entropy: per-token losses without the [tokens, vocab] logits.

``linear_cross_entropy(hidden, weight, labels)`` equals
``F.cross_entropy((hidden @ weight.T).float(), labels, reduction="none")``, the unfused
head and loss, but holds the logits of one chunk of ``chunk_tokens`` rows at a time:

* forward: per chunk, the chunk's logits in the operands' dtype (what ``nn.Linear``
  gives), their cross-entropy in fp32 (``F.cross_entropy`` on the upcast chunk, as the
  unfused loss computes it); only the [tokens] losses are kept.
* backward: per chunk, the logits are computed again, ``softmax - onehot(label)`` in
  fp32, scaled by each token's upstream gradient and cast to the operands' dtype (the
  gradient of the unfused ``.float()``), then the two GEMMs: the chunk's rows of the
  hidden gradient, and its term of the weight gradient, summed over chunks in fp32 (a
  [vocab, hidden] fp32 buffer during the backward: 1.4 GB at Nano's width; each term is
  rounded to the operands' dtype once, the unfused GEMM rounds the whole sum once).

Recomputation rather than liger-kernel's gradients-in-forward: liger keeps a [vocab,
hidden] weight gradient (and the [tokens, hidden] one) from the loss's forward to its
backward, one per head it is called for (each MTP depth), and needs the upstream
gradient to be a scalar; recomputing costs one more head GEMM (4 instead of 3) and holds
nothing but the inputs the unfused linear saves anyway. Any upstream gradient works, so
the caller weights, masks and averages the per-token losses with ordinary autograd.

Deterministic: chunks run in a fixed order and each reduction is a plain GEMM or sum,
so two runs on one device give the same bits.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

__all__ = ["DEFAULT_LOGITS_CHUNK_BYTES", "chunk_tokens_for", "linear_cross_entropy"]

DEFAULT_LOGITS_CHUNK_BYTES = 256 * 2**20
"""One chunk's fp32 logits: 256 MiB, 512 tokens at vocab 131072. Large enough that the
chunk's [512, hidden] x [hidden, vocab] GEMM runs at the device's GEMM rate (it is
hundreds of GFLOP at Nano's width), small beside the unfused [tokens, vocab] fp32 logits
(4 GiB at 8k tokens, more with their gradient). A chunk's transient working set is about
three times this (its logits, their fp32 copy and fp32 probabilities)."""


def chunk_tokens_for(vocab_size: int, chunk_bytes: int | None = None) -> int:
    """Rows per chunk so that one chunk's fp32 logits take ``chunk_bytes`` (None: the
    module's ``DEFAULT_LOGITS_CHUNK_BYTES``, read at the call)."""
    budget = DEFAULT_LOGITS_CHUNK_BYTES if chunk_bytes is None else chunk_bytes
    return max(1, budget // (4 * vocab_size))


def _logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return hidden @ weight.T


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        chunk: int,
    ) -> torch.Tensor:
        losses = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk):
            rows = slice(start, start + chunk)
            logits = _logits(hidden[rows], weight).float()
            losses[rows] = F.cross_entropy(logits, labels[rows], reduction="none")
        ctx.save_for_backward(hidden, weight, labels)
        ctx.chunk = chunk
        return losses

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad_losses: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None]:
        hidden, weight, labels = ctx.saved_tensors
        chunk: int = ctx.chunk
        want_hidden, want_weight = ctx.needs_input_grad[:2]
        grad_hidden = torch.empty_like(hidden) if want_hidden else None
        grad_weight = (
            torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
            if want_weight
            else None
        )
        for start in range(0, hidden.shape[0], chunk):
            rows = slice(start, start + chunk)
            probs = torch.softmax(_logits(hidden[rows], weight).float(), dim=-1)
            targets = torch.arange(probs.shape[0], device=probs.device)
            probs[targets, labels[rows]] -= 1.0
            grad_logits = probs.mul_(grad_losses[rows, None]).to(hidden.dtype)
            if grad_hidden is not None:
                grad_hidden[rows] = grad_logits @ weight
            if grad_weight is not None:
                grad_weight += (grad_logits.T @ hidden[rows]).float()
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None


def linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_tokens: int
) -> torch.Tensor:
    """[tokens] fp32 cross-entropy of ``hidden [tokens, d] @ weight[vocab, d].T`` against
    ``labels [tokens]``, ``chunk_tokens`` rows of logits at a time (any count of rows, the
    last chunk may be short). Differentiable in ``hidden`` and ``weight``."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    if hidden.shape[0] != labels.shape[0]:
        raise ValueError(f"{hidden.shape[0]} rows of hidden states but {labels.shape[0]} labels")
    losses: torch.Tensor = _LinearCrossEntropy.apply(hidden, weight, labels, chunk_tokens)
    return losses
