"""Ideal time of one micro-batch (forward and backward) through one pipeline rank, by term.

Each block contributes, for one micro-batch of ``m = micro_batch * seq_len / cp``
tokens per tensor-parallel group:

- its GEMMs: ``3 x 2 x rows x k x n`` FLOPs (forward, data and weight gradients) on
  the rank's shard, at the peak of the GEMM's format times a shape efficiency, and the
  casts a quantized GEMM needs (memory bound);
- its fused core (attention, the SSD scan): the longest of FLOPs at the BF16 peak, bytes
  at the HBM bandwidth and softmax exponentials at the special-function units' rate,
  forward, then backward at twice the FLOPs and bytes and the exponentials once again;
- its elementwise traffic at the HBM bandwidth;
- communication: TP/SP all-gather and reduce-scatter of the block input (two each way),
  the EP all-to-alls (dispatch and combine, each way), the CP exchange;
- recompute: with ``full`` the whole forward again, with ``selective`` the layer type's
  own modules (``LayerType.selective_recompute``);
- one fixed overhead per block.

A term is ``(group, key, coefficient, seconds)``: the fitted coefficient named turns
the ideal seconds into predicted ones (``factory.planner.perf_constants``).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from factory.planner.collectives import Links
from factory.planner.perf_terms import BlockTerms, GemmTerm, ModelTerms
from factory.schemas.model import ModelConfig
from factory.spec.activations import BF16
from factory.spec.layer_type import layer_type

__all__ = ["StageContext", "Term", "shape_efficiency", "stage_terms"]

Term = tuple[str, str, str, float]
"""(group, key, coefficient name, ideal seconds)."""

_CAST_BYTES = 3
"""A cast reads a BF16 value and writes a one-byte (or smaller) one."""


@dataclass(frozen=True)
class StageContext:
    """Everything one layout and GPU fix, as plain numbers."""

    model: ModelConfig
    terms: ModelTerms
    tokens: float
    """m: tokens of one micro-batch per tensor-parallel group (micro_batch * seq / cp)."""
    tp: int
    cp: int
    ep: int
    etp: int
    sequence_parallel: bool
    recompute: str
    generation: str
    bf16_peak: float
    low_peak: float
    """Peak of the recipe's format; the BF16 peak where the chip only emulates it."""
    quantizes: bool
    """The recipe quantizes its GEMMs (not bf16)."""
    emulated: bool
    hbm: float
    links: Links
    d0: float
    exp_rate: float = 0.0
    """Exponentials per second (``GPUSpec.exp_per_s``; 0: not modelled)."""


def shape_efficiency(rows: float, k: float, n: float, d0: float) -> float:
    return (rows / (rows + d0)) * (k / (k + d0)) * (n / (n + d0))


def _gemm_seconds(g: GemmTerm, ctx: StageContext, bf16: bool) -> tuple[float, float]:
    """(GEMM seconds, cast seconds) of one micro-batch, forward and backward."""
    m, tp = ctx.tokens, ctx.tp
    if g.expert:
        tokens = m / tp * ctx.etp * g.uses  # this rank's token copies, gathered over ETP
        rows = tokens * ctx.ep / g.experts  # per local expert
        k, n = (
            (g.in_features / ctx.etp, g.out_features)
            if g.split == "row"
            else (
                g.in_features,
                g.out_features / ctx.etp,
            )
        )
    else:
        tokens = m / tp if g.split == "none" and ctx.sequence_parallel else m
        tokens *= g.uses
        rows = tokens
        if g.split == "row":
            k, n = g.in_features / tp, g.out_features
        elif g.split == "column":
            k, n = g.in_features, g.out_features / tp
        else:
            k, n = g.in_features, g.out_features
    quantized = g.quantizable and not bf16 and ctx.quantizes
    peak = ctx.low_peak if quantized else ctx.bf16_peak
    flops = 3 * 2 * tokens * k * n
    seconds = flops / (peak * shape_efficiency(rows, k, n, ctx.d0))
    if not quantized:
        return seconds, 0.0
    # Forward casts the input; backward casts the output gradient twice (dgrad and the
    # transposed wgrad operand) and the input's transpose; emulation also dequantizes.
    values = tokens * (2 * k + 2 * n) * (2 if ctx.emulated else 1)
    return seconds, values * _CAST_BYTES / ctx.hbm


def _block_terms(block: BlockTerms, ctx: StageContext, bf16: bool, key: str) -> list[Term]:
    """One micro-batch through ``block``, forward and backward, with its recompute."""
    m, tp = ctx.tokens, ctx.tp
    gemm_s = cast_s = 0.0
    for g in block.gemms:
        g_s, c_s = _gemm_seconds(g, ctx, bf16)
        gemm_s, cast_s = gemm_s + g_s, cast_s + c_s
    flops_s = block.core_flops * m / tp / ctx.bf16_peak
    bytes_s = block.core_bytes * m / tp / ctx.hbm
    exp_s = block.core_exponentials * m / tp / ctx.exp_rate if ctx.exp_rate else 0.0
    # Backward doubles the products and the traffic but recomputes the softmax only once.
    core_s = max(flops_s, bytes_s, exp_s) + max(2 * flops_s, 2 * bytes_s, exp_s)
    elementwise = 3 * BF16 * block.elementwise_values * m / tp / ctx.hbm
    gemm_coef = f"gemm_{ctx.generation}"
    terms: list[Term] = [
        ("compute", key, gemm_coef, gemm_s),
        ("compute", key, block.core_coefficient, core_s),
        ("compute", key, "memory", elementwise + cast_s),
        ("overhead", "blocks", "overhead", 1.0),
    ]
    if block.dispatch_values:  # dropless routing waits for the token counts on the host
        terms.append(("overhead", "routing", "routing_sync", 1.0))
    comm = _comm_terms(block, ctx)
    terms += comm
    if ctx.recompute == "full":
        terms += [("recompute", key, c, s / 3) for _, _, c, s in terms[:3]]
        terms += [("recompute", key, c, s / 2) for _, _, c, s in comm]
    elif ctx.recompute == "selective":
        again_flops = block.selective_core_flops * m / tp / ctx.bf16_peak
        again_core = max(again_flops, exp_s) if again_flops else 0.0
        again_memory = 2 * BF16 * block.selective_elementwise_values * m / tp / ctx.hbm
        terms += [
            ("recompute", key, "core", again_core),
            ("recompute", key, "memory", again_memory),
        ]
    return terms


def _comm_terms(block: BlockTerms, ctx: StageContext) -> list[Term]:
    m, tp, links = ctx.tokens, ctx.tp, ctx.links
    terms: list[Term] = []
    if tp > 1:  # all-gather before and reduce-scatter after the mixer, forward and backward
        nbytes = BF16 * m * ctx.terms.hidden_size
        terms.append(("communication", "tp", "comm", 4 * links.ring_seconds(nbytes, tp, 1)))
    if block.dispatch_values and ctx.ep > 1:  # dispatch and combine, forward and backward
        nbytes = BF16 * m / tp * ctx.etp * block.dispatch_values
        a2a = links.all_to_all_seconds(nbytes, ctx.ep, ctx.etp)
        terms.append(("communication", "ep", "comm", 4 * a2a))
    if ctx.cp > 1:
        values = layer_type(block.symbol).cp_exchange_values(ctx.model, ctx.cp)
        if values:
            nbytes = BF16 * m / tp * values
            crosses = tp * ctx.cp > links.nvlink_domain
            seconds = 3 * links.p2p_seconds(nbytes, crosses)
            terms.append(("communication", "cp", "comm", seconds))
    return terms


def _head_terms(ctx: StageContext, heads: int) -> list[Term]:
    """The output head (vocab-parallel, BF16) and its cross-entropy, once per head."""
    h, vocab = ctx.terms.hidden_size, ctx.terms.vocab_size
    head = GemmTerm(h, vocab, 1, "column", False, 0, False)
    gemm_s, _ = _gemm_seconds(head, ctx, bf16=True)
    loss = 3 * BF16 * 4 * vocab / ctx.tp * ctx.tokens / ctx.hbm
    return [
        ("compute", "head", f"gemm_{ctx.generation}", heads * gemm_s),
        ("compute", "head", "memory", heads * loss),
    ]


def stage_terms(
    ctx: StageContext, layers: list[int], bf16_layers: frozenset[int], last: bool
) -> list[Term]:
    """Terms of one micro-batch through the main-stack ``layers`` a rank runs (and, on the
    ``last`` rank, the head and the MTP blocks); ``bf16_layers`` are kept out of the recipe."""
    counts = Counter((ctx.terms.main[i], i in bf16_layers) for i in layers)
    cached: list[Term] = []
    for (block, bf16), count in counts.items():
        cached += [
            (g, k, c, s * count) for g, k, c, s in _block_terms(block, ctx, bf16, block.name)
        ]
    if last:
        cached += _head_terms(ctx, 1 + ctx.terms.mtp_heads)
        for block, applications in ctx.terms.mtp:
            block_terms = _block_terms(block, ctx, False, "mtp")
            cached += [(g, k, c, s * applications) for g, k, c, s in block_terms]
    return cached
