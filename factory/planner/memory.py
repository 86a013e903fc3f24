"""Device memory per pipeline rank, in bytes: model state plus activations.

Megatron's own estimator (``theoretical_memory_usage.py``) returns early for
hybrid Mamba models and ignores MoE token expansion and CP, so this module
keeps Megatron's accounting for weights, gradients and optimizer state
(``parallelism.md`` §2.1) and adds its own per-layer activation formulas.
Every pipeline rank is evaluated, because the first rank holds the most
in-flight micro-batches while the last holds the head, the logits and MTP.

Assumptions: activations are bf16 whatever the precision recipe (FP8/FP4
copies saved by Transformer Engine are not modelled); full recompute's
transient (one layer rematerialised during its backward) is not added; the
vocabulary is not padded to a multiple of 128 x TP.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from factory.planner.layout import Layout
from factory.planner.params import LayerParams, layer_params
from factory.schemas.blueprint import Blueprint
from factory.schemas.model import ModelConfig
from factory.schemas.pattern import LAYER_SYMBOLS

__all__ = ["ActivationMemory", "MemoryPlan", "ParamsOnRank", "RankMemory", "memory_per_rank"]

BF16, FP32, INT64 = 2, 4, 8
WEIGHT_BYTES = BF16  # bf16 parameters
GRAD_BYTES = FP32  # fp32 main gradients (Megatron's grad buffer for bf16 training)
OPTIM_BYTES = 3 * FP32  # fp32 master weights + Adam m and v
SELECTIVE_MODULES = ("core_attn", "moe_act")
"""What ``recompute: selective`` recomputes, in Megatron's ``recompute_modules`` names:
core_attn is Megatron's default, moe_act is what the Nemotron 3 recipes add."""


@dataclass(frozen=True)
class ParamsOnRank:
    """Parameters one GPU holds: dense / TP, replicated in full, experts / (ETP x EP)."""

    dense: int
    replicated: int
    expert: int

    @property
    def total(self) -> int:
        return self.dense + self.replicated + self.expert


@dataclass(frozen=True)
class ActivationMemory:
    """Activation bytes saved for backward on one rank (bf16 unless stated)."""

    per_layer_type: dict[str, int]
    """Bytes per layer per micro-batch, for each layer type of the model."""
    in_flight_microbatches: float
    """Micro-batches whose activations are alive at once on this rank."""
    layers: int
    """Bytes per micro-batch of this rank's main-stack layers."""
    embedding: int
    """Bytes per micro-batch of the token ids and embedding output (first rank)."""
    mtp: int
    """Bytes per micro-batch of every MTP depth (the MTP rank)."""
    head: int
    """Final-norm input/output and fp32 logits of the main and MTP heads (last rank), counted
    once: the last stage runs a micro-batch's backward right after its forward."""
    total: int


@dataclass(frozen=True)
class RankMemory:
    """Memory of one GPU on pipeline rank ``pp_rank``."""

    pp_rank: int
    layers: str
    params_on_rank: ParamsOnRank
    weights: int
    gradients: int
    optimizer: dict[str, int]
    """fp32 master + Adam state; keys 'distributed_optimizer', 'no_distributed_optimizer'."""
    weights_grads_optimizer: dict[str, int]
    """weights + gradients + optimizer, under the same two keys."""
    activations: ActivationMemory
    total: int
    """weights_grads_optimizer under the blueprint's own optimizer choice, plus activations."""

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


@dataclass(frozen=True)
class MemoryPlan:
    """Memory of every pipeline rank; the flat fields describe the peak rank."""

    distributed_optimizer: bool
    recompute: str
    peak_rank: int
    per_rank: tuple[RankMemory, ...]

    @property
    def peak(self) -> RankMemory:
        return self.per_rank[self.peak_rank]

    @property
    def params_on_rank(self) -> ParamsOnRank:
        return self.peak.params_on_rank

    @property
    def weights_grads_optimizer(self) -> dict[str, int]:
        return self.peak.weights_grads_optimizer

    @property
    def activations(self) -> ActivationMemory:
        return self.peak.activations

    @property
    def total(self) -> int:
        return self.peak.total

    def to_dict(self) -> dict[str, object]:
        peak = self.peak.to_dict()
        del peak["pp_rank"]
        return {
            "peak_rank": self.peak_rank,
            "distributed_optimizer": self.distributed_optimizer,
            "recompute": self.recompute,
            **peak,
            "per_rank": [rank.to_dict() for rank in self.per_rank],
        }


# --------------------------------------------------------------------------- parameters


def _layers(model: ModelConfig, symbols: str) -> LayerParams:
    total = LayerParams(0, 0, 0, 0)
    for symbol in symbols:
        total += layer_params(model, LAYER_SYMBOLS[symbol])
    return total


def _unsharded_params(model: ModelConfig, layout: Layout, rank: int) -> LayerParams:
    """Unsharded parameters on ``rank``: its layers, embedding/head, final norm and MTP.

    Megatron places the embedding on the first stage and the head on the last.
    With pp > 1 the last stage owns a copy of the embedding matrix when the
    head is tied, and also when MTP runs there (MTP embeds the shifted tokens),
    so an untied model with MTP holds embedding and head on the last rank.
    """
    d, vocab = model.hidden_size, model.vocab_size
    own = _layers(model, layout.layers_on_rank(rank))
    dense, replicated, expert = own.dense, own.replicated, own.expert
    last = layout.pp - 1
    mtp_here = bool(model.mtp_depth) and rank == layout.mtp_on_rank
    if rank == 0:
        dense += vocab * d
    if rank == last:
        replicated += d  # final norm
        if not model.tie_embeddings or last > 0:
            dense += vocab * d  # the head, or the tied copy that serves as head
        if mtp_here and last > 0 and not model.tie_embeddings:
            dense += vocab * d  # embedding copy for MTP
    if mtp_here:
        block = _layers(model, model.mtp_pattern)
        blocks = model.mtp_stored_blocks
        dense += blocks * (2 * d * d + block.dense)  # eh_proj [d, 2d] is TP-sharded
        replicated += blocks * (3 * d + block.replicated)  # enorm, hnorm, final norm
        expert += blocks * block.expert
    return LayerParams(dense, replicated, expert, 0)


def _params_on_rank(model: ModelConfig, layout: Layout, rank: int) -> ParamsOnRank:
    p = _unsharded_params(model, layout, rank)
    return ParamsOnRank(
        dense=math.ceil(p.dense / layout.tp),
        replicated=p.replicated,
        expert=math.ceil(p.expert / (layout.etp * layout.ep)),
    )


def _optimizer_bytes(params: ParamsOnRank, layout: Layout, instances: int) -> dict[str, int]:
    """fp32 master + Adam m, v: 12 B/param, or 12/d with the distributed optimizer.

    Megatron's estimator shards dense and replicated state over DP only; the
    distributed optimizer really shards it over the dp_cp group (gradients are
    reduced over DP x CP), so d = DP*CP/instances here. Expert state shards
    over EDP/instances.
    """
    non_expert = params.dense + params.replicated
    d_dense = layout.dp * layout.cp / instances
    d_expert = layout.edp / instances
    sharded = math.ceil(OPTIM_BYTES * non_expert / d_dense) + math.ceil(
        OPTIM_BYTES * params.expert / d_expert
    )
    return {
        "distributed_optimizer": sharded,
        "no_distributed_optimizer": OPTIM_BYTES * params.total,
    }


# --------------------------------------------------------------------------- activations


@dataclass(frozen=True)
class _Tokens:
    """Token counts of one micro-batch on one rank, and how [tokens, width] tensors shard."""

    n: int  # (seq_len / CP) * micro_batch
    tp: int
    sp: bool
    etp: int

    def replicated(self, width: int) -> float:
        """Elements of an [n, width] tensor that TP replicates unless sequence parallel is on."""
        return self.n * width / (self.tp if self.sp else 1)

    def sharded(self, width: int) -> float:
        """Elements of an [n, width] tensor whose width TP splits."""
        return self.n * width / self.tp


def _prologue(t: _Tokens, h: int) -> float:
    """Pre-norm fused into the first linear (TE LayerNormLinear): its input, its output
    (the linear's saved input) and the fp32 rstd per token."""
    return BF16 * 2 * t.replicated(h) + FP32 * t.replicated(1)


def _attention_bytes(model: ModelConfig, t: _Tokens, recompute: str) -> float:
    """Flash attention: Q, K, V and the output O (also linear_proj's input); no s^2 tensor.

    Its fp32 softmax log-sum-exp is the only thing core_attn recompute frees.
    KV heads are replicated when TP exceeds their number.
    """
    cfg = model.attention
    assert cfg is not None
    q = cfg.heads * cfg.head_dim
    kv_local = math.ceil(cfg.kv_heads / t.tp) * cfg.head_dim
    saved = _prologue(t, model.hidden_size) + BF16 * (2 * t.sharded(q) + 2 * t.n * kv_local)
    if recompute == "none":
        saved += FP32 * t.sharded(cfg.heads)
    return saved


def _mamba_bytes(model: ModelConfig, t: _Tokens) -> float:
    """Megatron's memory-efficient path (mamba_split_conv1d_scan_combined, checkpoint level 1)
    keeps the packed in_proj output and recomputes conv1d and the scan in backward; the gated
    norm keeps an fp32 rstd per group and out_proj keeps its input. No selective module exists
    for Mamba, so selective equals none."""
    cfg = model.mamba
    assert cfg is not None
    return (
        _prologue(t, model.hidden_size)
        + BF16 * t.sharded(cfg.in_proj_dim)
        + FP32 * t.sharded(cfg.groups)
        + BF16 * t.sharded(cfg.d_inner)
    )


def _ffn_bytes(width_elems: float, activation: str, keep_act_output: bool) -> float:
    """fc1 output (both halves when gated) and the activation output (fc2's input)."""
    fc1 = width_elems * (2 if activation == "swiglu" else 1)
    return BF16 * (fc1 + (width_elems if keep_act_output else 0))


def _moe_bytes(model: ModelConfig, t: _Tokens, recompute: str) -> float:
    """Router scores (fp32), routed tokens x top_k at the expert width, expert intermediates
    (sharded over ETP), the combined latent (fc2_latent_proj's input) and the shared expert.

    Dispatch: a rank's n/TP tokens (SP) fan out top_k times and the ETP group gathers them, so
    a rank computes n*top_k*ETP/TP routed tokens at width latent_size (or hidden), with
    ff/ETP-wide intermediates. moe_act recompute drops the routed activation output.
    """
    cfg = model.moe
    assert cfg is not None
    h, width = model.hidden_size, cfg.latent_size or model.hidden_size
    routed = t.n * cfg.top_k * t.etp / t.tp
    saved = _prologue(t, h) + FP32 * t.replicated(cfg.num_experts) + BF16 * routed * width
    keep_act = recompute == "none"
    ff_local = cfg.expert_intermediate_size / t.etp
    saved += _ffn_bytes(routed * ff_local, cfg.activation, keep_act_output=keep_act)
    if cfg.latent_size:
        saved += BF16 * t.replicated(cfg.latent_size)
    if cfg.shared_expert_intermediate_size:
        shared = t.sharded(cfg.shared_expert_intermediate_size)
        saved += _ffn_bytes(shared, cfg.activation, keep_act_output=True)
    return saved


def _layer_bytes(model: ModelConfig, layer_type: str, t: _Tokens, recompute: str) -> int:
    """Bytes one layer saves for backward per micro-batch on one rank."""
    if recompute == "full":
        return math.ceil(BF16 * t.replicated(model.hidden_size))  # the checkpointed layer input
    if layer_type == "attention":
        return math.ceil(_attention_bytes(model, t, recompute))
    if layer_type == "mamba":
        return math.ceil(_mamba_bytes(model, t))
    if layer_type == "mlp" and model.mlp is not None:
        ffn = _ffn_bytes(t.sharded(model.mlp.intermediate_size), model.mlp.activation, True)
        return math.ceil(_prologue(t, model.hidden_size) + ffn)
    return math.ceil(_moe_bytes(model, t, recompute))


def _in_flight(layout: Layout, rank: int) -> float:
    """Micro-batches alive on ``rank`` (in units of all of the rank's layers).

    1F1B: min(pp - rank, M). Interleaved: Megatron's warm-up of
    2*(pp - rank - 1) + (vpp - 1)*pp model chunks plus one, capped at M*vpp and
    divided by vpp; on rank 0 that is pp * (1 + (pp - 1)/(pp * vpp)).
    """
    pp, vpp, m = layout.pp, layout.vpp, layout.num_microbatches
    if vpp == 1:
        return float(min(pp - rank, m))
    chunks = 2 * (pp - rank - 1) + (vpp - 1) * pp + 1
    return min(chunks, m * vpp) / vpp


def _activations(
    model: ModelConfig, layout: Layout, rank: int, per_type: dict[str, int], t: _Tokens
) -> ActivationMemory:
    h = model.hidden_size
    layers = sum(per_type[LAYER_SYMBOLS[c]] for c in layout.layers_on_rank(rank))
    embedding = INT64 * t.n + BF16 * t.replicated(h) if rank == 0 else 0
    mtp = 0.0
    if model.mtp_depth and rank == layout.mtp_on_rank:
        inner = sum(per_type[LAYER_SYMBOLS[c]] for c in model.mtp_pattern)
        # enorm and hnorm inputs, and eh_proj's [n, 2h] input
        mtp = model.mtp_depth * (inner + BF16 * t.replicated(4 * h))
    head = 0.0
    if rank == layout.pp - 1:
        logits = FP32 * t.sharded(model.vocab_size) * (1 + model.mtp_depth)
        head = BF16 * 2 * t.replicated(h) + logits
    in_flight = _in_flight(layout, rank)
    return ActivationMemory(
        per_layer_type=dict(per_type),
        in_flight_microbatches=in_flight,
        layers=layers,
        embedding=math.ceil(embedding),
        mtp=math.ceil(mtp),
        head=math.ceil(head),
        total=math.ceil(in_flight * (layers + embedding + mtp) + head),
    )


# --------------------------------------------------------------------------- plan


def memory_per_rank(bp: Blueprint, layout: Layout) -> MemoryPlan:
    """Memory of every pipeline rank of ``bp`` laid out as ``layout``; the peak is the largest
    total (the first such rank on a tie)."""
    model, par = bp.model, bp.parallelism
    seq_local = bp.data.seq_len / layout.cp
    tokens = _Tokens(
        n=math.ceil(seq_local * layout.micro_batch_size),
        tp=layout.tp,
        sp=layout.sequence_parallel,
        etp=layout.etp,
    )
    types = sorted(
        {LAYER_SYMBOLS[c] for c in model.layout.main + model.mtp_pattern},
        key=list(LAYER_SYMBOLS.values()).index,
    )
    per_type = {name: _layer_bytes(model, name, tokens, par.recompute) for name in types}
    choice = "distributed_optimizer" if par.distributed_optimizer else "no_distributed_optimizer"
    ranks: list[RankMemory] = []
    for rank in range(layout.pp):
        params = _params_on_rank(model, layout, rank)
        weights = WEIGHT_BYTES * params.total
        grads = GRAD_BYTES * params.total
        optimizer = _optimizer_bytes(params, layout, par.distributed_optimizer_instances)
        state = {key: weights + grads + value for key, value in optimizer.items()}
        activations = _activations(model, layout, rank, per_type, tokens)
        ranks.append(
            RankMemory(
                pp_rank=rank,
                layers=layout.layers_on_rank(rank),
                params_on_rank=params,
                weights=weights,
                gradients=grads,
                optimizer=optimizer,
                weights_grads_optimizer=state,
                activations=activations,
                total=state[choice] + activations.total,
            )
        )
    peak = max(range(layout.pp), key=lambda r: (ranks[r].total, -r))
    return MemoryPlan(
        distributed_optimizer=par.distributed_optimizer,
        recompute=par.recompute,
        peak_rank=peak,
        per_rank=tuple(ranks),
    )
