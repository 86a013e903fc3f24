"""Building blocks of the activation-memory formulas each layer type declares.

The accounting follows Korthikanti et al. 2022, "Reducing Activation
Recomputation in Large Transformer Models" (arXiv:2205.05198), with Transformer
Engine's fused kernels as Megatron-Core runs them; ``docs/memory.md`` derives
each term. Activations are bf16 unless a term says otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["BF16", "FP32", "INT64", "TokenShards", "ffn_bytes", "prologue_bytes"]

BF16, FP32, INT64 = 2, 4, 8


@dataclass(frozen=True)
class TokenShards:
    """Token counts of one micro-batch on one rank, and how [tokens, width] tensors shard."""

    n: int
    """(seq_len / CP) * micro_batch."""
    tp: int
    sp: bool
    etp: int

    def replicated(self, width: int) -> float:
        """Elements of an [n, width] tensor that TP replicates unless sequence parallel is on."""
        return self.n * width / (self.tp if self.sp else 1)

    def sharded(self, width: int) -> float:
        """Elements of an [n, width] tensor whose width TP splits."""
        return self.n * width / self.tp


def prologue_bytes(tokens: TokenShards, hidden: int) -> float:
    """Pre-norm fused into the first linear (TE LayerNormLinear): its input, its output
    (the linear's saved input) and the fp32 rstd per token."""
    return BF16 * 2 * tokens.replicated(hidden) + FP32 * tokens.replicated(1)


def ffn_bytes(width_elems: float, activation: str, keep_act_output: bool) -> float:
    """fc1 output (both halves when gated) and the activation output (fc2's input)."""
    fc1 = width_elems * (2 if activation == "swiglu" else 1)
    return BF16 * (fc1 + (width_elems if keep_act_output else 0))
