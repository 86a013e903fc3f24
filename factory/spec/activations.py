"""Building blocks of the activation-memory formulas each layer type declares.

The accounting follows Korthikanti et al. 2022, "Reducing Activation
Recomputation in Large Transformer Models" (arXiv:2205.05198), with Transformer
Engine's fused kernels as Megatron-Core runs them; ``docs/memory.md`` derives
each term. Activations are bf16 unless a term says otherwise; a tensor kept only as a
quantized GEMM's input (for its weight gradient) is kept in the recipe's format, as
Transformer Engine keeps it (:attr:`TokenShards.gemm_input`).
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
    gemm_input: float = BF16
    """Bytes per element a GEMM keeps of its input for the weight gradient: 2 in BF16; under
    a quantizing recipe, the quantized copy (the recipe's ``saved_input_bytes``)."""

    def replicated(self, width: int) -> float:
        """Elements of an [n, width] tensor that TP replicates unless sequence parallel is on."""
        return self.n * width / (self.tp if self.sp else 1)

    def sharded(self, width: int) -> float:
        """Elements of an [n, width] tensor whose width TP splits."""
        return self.n * width / self.tp


def prologue_bytes(tokens: TokenShards, hidden: int) -> float:
    """Pre-norm fused into the first linear (TE LayerNormLinear): its input, its output
    (the linear's saved input) and the fp32 rstd per token."""
    replicated = tokens.replicated(hidden)
    return (BF16 + tokens.gemm_input) * replicated + FP32 * tokens.replicated(1)


def ffn_bytes(
    tokens: TokenShards, width_elems: float, activation: str, keep_act_output: bool
) -> float:
    """fc1 output (both halves when gated), which the activation's backward reads, and the
    activation output, fc2's saved input."""
    fc1 = width_elems * (2 if activation == "swiglu" else 1)
    return BF16 * fc1 + (tokens.gemm_input * width_elems if keep_act_output else 0)
