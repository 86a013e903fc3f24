"""Exact parameter counts, per layer type and for the whole model.

Every count is derived from the blueprint alone, so it can be checked against
the published checkpoint sizes (``architecture.md`` §1) and, from the graph
issue on, against the instantiated ``nn.Module``. Norm weights, conv biases,
the router's expert bias and the SSM's A_log/D/dt_bias all count.
"""

from __future__ import annotations

from dataclasses import dataclass

from factory.schemas.model import AttentionConfig, MambaConfig, MLPConfig, ModelConfig, MoEConfig
from factory.schemas.pattern import LAYER_SYMBOLS

__all__ = ["LayerParams", "ModelParams", "count_params", "layer_params"]


@dataclass(frozen=True)
class LayerParams:
    """Parameters of one residual block (pre-norm included), split by how they shard.

    ``dense`` shards over TP; ``replicated`` is copied on every TP rank (norms,
    router, latent projections); ``expert`` holds routed experts, sharded over
    ETP x EP. ``active`` is what one token touches.
    """

    dense: int
    replicated: int
    expert: int
    active: int

    @property
    def total(self) -> int:
        return self.dense + self.replicated + self.expert

    def __add__(self, other: LayerParams) -> LayerParams:
        return LayerParams(
            self.dense + other.dense,
            self.replicated + other.replicated,
            self.expert + other.expert,
            self.active + other.active,
        )


def _attention(d: int, cfg: AttentionConfig) -> LayerParams:
    q = cfg.heads * cfg.head_dim
    kv = cfg.kv_heads * cfg.head_dim
    weights = d * q + 2 * d * kv + q * d
    biases = (q + 2 * kv + d) if cfg.bias else 0
    return LayerParams(dense=weights + biases, replicated=d, expert=0, active=weights + biases + d)


def _mamba(d: int, cfg: MambaConfig) -> LayerParams:
    in_proj = d * cfg.in_proj_dim + (cfg.in_proj_dim if cfg.bias else 0)
    conv = cfg.conv_dim * cfg.conv_kernel + (cfg.conv_dim if cfg.conv_bias else 0)
    per_head = 3 * cfg.heads  # A_log, D, dt_bias
    gated_norm = cfg.d_inner
    out_proj = cfg.d_inner * d + (d if cfg.bias else 0)
    dense = in_proj + conv + per_head + gated_norm + out_proj
    return LayerParams(dense=dense, replicated=d, expert=0, active=dense + d)


def _mlp_weights(d_in: int, width: int, activation: str, bias: bool) -> int:
    """An MLP d_in -> width -> d_in: two matrices, three when gated."""
    matrices = 3 if activation == "swiglu" else 2
    biases = ((matrices - 1) * width + d_in) if bias else 0
    return matrices * d_in * width + biases


def _mlp(d: int, cfg: MLPConfig) -> LayerParams:
    weights = _mlp_weights(d, cfg.intermediate_size, cfg.activation, cfg.bias)
    return LayerParams(dense=weights, replicated=d, expert=0, active=weights + d)


def _moe(d: int, cfg: MoEConfig, mlp_bias: bool) -> LayerParams:
    router = cfg.num_experts * d + (cfg.num_experts if cfg.router.expert_bias else 0)
    width = cfg.latent_size or d
    one_expert = _mlp_weights(width, cfg.expert_intermediate_size, cfg.activation, bias=False)
    shared = 0
    if cfg.shared_expert_intermediate_size:
        shared = _mlp_weights(d, cfg.shared_expert_intermediate_size, cfg.activation, mlp_bias)
    latent = 0
    if cfg.latent_size:
        bias = (cfg.latent_size + d) if mlp_bias else 0
        latent = 2 * d * cfg.latent_size + bias
    replicated = d + router + latent  # pre-norm, router and the duplicated latent projections
    return LayerParams(
        dense=shared,
        replicated=replicated,
        expert=cfg.num_experts * one_expert,
        active=shared + replicated + cfg.top_k * one_expert,
    )


def layer_params(model: ModelConfig, layer_type: str) -> LayerParams:
    """Parameters of one layer of ``layer_type`` ('mamba', 'attention', 'mlp' or 'moe')."""
    d = model.hidden_size
    if layer_type == "attention" and model.attention is not None:
        return _attention(d, model.attention)
    if layer_type == "mamba" and model.mamba is not None:
        return _mamba(d, model.mamba)
    if layer_type == "mlp" and model.mlp is not None:
        return _mlp(d, model.mlp)
    if layer_type == "moe" and model.moe is not None:
        return _moe(d, model.moe, mlp_bias=model.mlp.bias if model.mlp else False)
    raise ValueError(f"model has no {layer_type!r} section for its pattern")


@dataclass(frozen=True)
class ModelParams:
    """Parameter counts of a whole model."""

    total: int
    """Everything instantiated, MTP blocks included."""
    total_main: int
    """Without MTP."""
    active: int
    """Main-model parameters one token touches, embedding and head included."""
    embedding: int
    head: int
    final_norm: int
    mtp: int
    """Parameters of the stored MTP blocks (one block when repeated)."""
    by_layer_type: dict[str, dict[str, int]]
    """Per type: count of layers, parameters per layer, active per layer, and the total."""


def _mtp_block(model: ModelConfig) -> int:
    """One MTP block: enorm, hnorm, eh_proj [d, 2d], the inner layers and a final norm."""
    d = model.hidden_size
    inner = sum(layer_params(model, LAYER_SYMBOLS[c]).total for c in model.mtp_pattern)
    return 2 * d + 2 * d * d + inner + d


def count_params(model: ModelConfig) -> ModelParams:
    """Count every parameter of ``model``."""
    d, vocab = model.hidden_size, model.vocab_size
    by_type: dict[str, dict[str, int]] = {}
    body_total = body_active = 0
    for layer_type, count in model.layout.counts().items():
        if not count:
            continue
        one = layer_params(model, layer_type)
        by_type[layer_type] = {
            "layers": count,
            "per_layer": one.total,
            "active_per_layer": one.active,
            "total": one.total * count,
        }
        body_total += one.total * count
        body_active += one.active * count
    embedding = vocab * d
    head = 0 if model.tie_embeddings else vocab * d
    final_norm = d
    total_main = embedding + head + final_norm + body_total
    mtp = model.mtp_stored_blocks * _mtp_block(model) if model.mtp_depth else 0
    return ModelParams(
        total=total_main + mtp,
        total_main=total_main,
        active=embedding + head + final_norm + body_active,
        embedding=embedding,
        head=head,
        final_norm=final_norm,
        mtp=mtp,
        by_layer_type=by_type,
    )
