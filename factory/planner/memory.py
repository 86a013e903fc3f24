"""Device memory per pipeline rank, in bytes: model state plus activations.

Megatron's own estimator (``theoretical_memory_usage.py``) returns early for
hybrid Mamba models and ignores MoE token expansion and CP, so this module
keeps Megatron's accounting for weights, gradients and optimizer state
(``docs/memory.md``, 'Model state') and adds its own per-layer activation
formulas (``docs/memory.md``, 'Activations').
Every pipeline rank is evaluated, because the first rank holds the most
in-flight micro-batches while the last holds the head, the logits and MTP.

Assumptions: activations are bf16, except a tensor kept only as a quantized GEMM's input,
which Transformer Engine keeps in the recipe's format (its ``saved_input_bytes``) in the
layers the recipe quantizes; full recompute's transient (one layer rematerialised during
its backward) is not added; the vocabulary is not padded to a multiple of 128 x TP.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

from factory.layers import mtp as mtp_block
from factory.layers.model_spec import ModelSpec, model_spec
from factory.planner.layout import Layout
from factory.planner.params import LayerParams, tensor_params
from factory.schemas.blueprint import Blueprint
from factory.schemas.model import ModelConfig
from factory.schemas.precision_recipes import recipe_named
from factory.spec.activations import BF16, FP32, INT64, TokenShards
from factory.spec.layer_type import LAYER_TYPES, LayerType, layer_type

__all__ = ["ActivationMemory", "MemoryPlan", "ParamsOnRank", "RankMemory", "memory_per_rank"]

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


def _unsharded_params(spec: ModelSpec, layout: Layout, rank: int) -> LayerParams:
    """Unsharded parameters on ``rank``: its layers, embedding/head, final norm and MTP.

    Megatron places the embedding on the first stage and the head on the last.
    With pp > 1 the last stage owns a copy of the embedding matrix when the
    head is tied, and also when MTP runs there (MTP embeds the shifted tokens),
    so an untied model with MTP holds embedding and head on the last rank.
    """
    model = spec.model
    main = spec.main_layers
    own = tensor_params(t for i in layout.layer_indices_on_rank(rank) for t in main[i].tensors)
    dense, replicated, expert = own.dense, own.replicated, own.expert
    last = layout.pp - 1
    mtp_here = bool(model.mtp_depth) and rank == layout.mtp_on_rank
    vocab_matrix = spec.embedding.numel
    if rank == 0:
        dense += vocab_matrix
    if rank == last:
        replicated += spec.final_norm.numel
        if not model.tie_embeddings or last > 0:
            dense += vocab_matrix  # the head, or the tied copy that serves as head
        if mtp_here and last > 0 and not model.tie_embeddings:
            dense += vocab_matrix  # embedding copy for MTP
    if mtp_here:
        blocks = tensor_params(t for layer in spec.mtp_layers for t in layer.tensors)
        dense, replicated = dense + blocks.dense, replicated + blocks.replicated
        expert += blocks.expert
    return LayerParams(dense, replicated, expert, 0)


def _params_on_rank(spec: ModelSpec, layout: Layout, rank: int) -> ParamsOnRank:
    p = _unsharded_params(spec, layout, rank)
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


def _layer_bytes(model: ModelConfig, kind: LayerType, t: TokenShards, recompute: str) -> int:
    """Bytes one layer saves for backward per micro-batch on one rank."""
    if recompute == "full":
        return math.ceil(BF16 * t.replicated(model.hidden_size))  # the checkpointed layer input
    return math.ceil(kind.activation_bytes(model, t, recompute))


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
    model: ModelConfig,
    layout: Layout,
    rank: int,
    per_type: tuple[dict[str, int], dict[str, int]],
    bf16_layers: frozenset[int],
    t: TokenShards,
) -> ActivationMemory:
    """``per_type``: each layer type's bytes in the recipe's layers and in BF16 layers."""
    h = model.hidden_size
    quantized, kept = per_type
    layers = sum(
        (kept if i in bf16_layers else quantized)[layer_type(model.parsed_pattern.main[i]).name]
        for i in layout.layer_indices_on_rank(rank)
    )
    embedding = INT64 * t.n + BF16 * t.replicated(h) if rank == 0 else 0
    mtp = 0.0
    if model.mtp_depth and rank == layout.mtp_on_rank:
        inner = sum(kept[layer_type(c).name] for c in model.mtp_pattern)
        mtp = mtp_block.activation_bytes(model, t, inner)
    head = 0.0
    if rank == layout.pp - 1:
        logits = FP32 * t.sharded(model.vocab_size) * (1 + model.mtp_depth)
        head = BF16 * 2 * t.replicated(h) + logits
    in_flight = _in_flight(layout, rank)
    return ActivationMemory(
        per_layer_type=dict(quantized),
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
    tokens = TokenShards(
        n=math.ceil(seq_local * layout.micro_batch_size),
        tp=layout.tp,
        sp=layout.sequence_parallel,
        etp=layout.etp,
    )
    used = set(model.parsed_pattern.main + model.mtp_pattern)
    in_recipe = replace(tokens, gemm_input=recipe_named(bp.precision.recipe).saved_input_bytes)
    per_type = tuple(
        {
            kind.name: _layer_bytes(model, kind, shards, par.recompute)
            for symbol, kind in LAYER_TYPES.items()
            if symbol in used
        }
        for shards in (in_recipe, tokens)
    )
    bf16_layers = bp.precision.high_precision.indices(model.num_layers)
    spec = model_spec(model)
    choice = "distributed_optimizer" if par.distributed_optimizer else "no_distributed_optimizer"
    ranks: list[RankMemory] = []
    for rank in range(layout.pp):
        params = _params_on_rank(spec, layout, rank)
        weights = WEIGHT_BYTES * params.total
        grads = GRAD_BYTES * params.total
        optimizer = _optimizer_bytes(params, layout, par.distributed_optimizer_instances)
        state = {key: weights + grads + value for key, value in optimizer.items()}
        activations = _activations(model, layout, rank, per_type, bf16_layers, tokens)
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
