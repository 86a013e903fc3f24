"""The multi-token-prediction block (DeepSeek-V3, arXiv:2412.19437, section 2.2).

Depth k predicts token t+k+1 from ``eh_proj(concat[enorm(emb(t+k)), hnorm(h)])``
followed by the block's inner layers (``model.mtp_pattern``), a final norm and
the shared head. The tensors mirror the released checkpoints: inner layer
``j = block * len(pattern) + i`` lives at ``mtp.layers.{j}``, with enorm,
hnorm and eh_proj on a block's first inner layer and ``final_layernorm`` on
its last. In repeated mode one stored block serves every depth.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from factory.spec.activations import BF16, TokenShards
from factory.spec.tensors import Init, TensorSpec, linear, norm

if TYPE_CHECKING:
    from factory.schemas.model import ModelConfig

__all__ = [
    "BRIDGE_LOSS_SCALE",
    "DEFAULT_HF_PATTERN",
    "activation_bytes",
    "first_layer_tensors",
    "from_hf",
    "hf_config",
    "last_layer_tensors",
    "layer_prefix",
]


def layer_prefix(block: int, inner: int, pattern_length: int) -> str:
    return f"mtp.layers.{block * pattern_length + inner}"


def first_layer_tensors(model: ModelConfig, prefix: str) -> list[TensorSpec]:
    """enorm and hnorm (replicated) and eh_proj [d, 2d] (column-parallel in Megatron)."""
    d = model.hidden_size
    return [
        norm(f"{prefix}.enorm.weight", d),
        norm(f"{prefix}.hnorm.weight", d),
        *linear(f"{prefix}.eh_proj", 2 * d, d, bias=False, tp="column", init=Init("normal")),
    ]


def last_layer_tensors(model: ModelConfig, prefix: str) -> list[TensorSpec]:
    return [norm(f"{prefix}.final_layernorm.weight", model.hidden_size)]


def activation_bytes(model: ModelConfig, tokens: TokenShards, inner_bytes: float) -> float:
    """Every depth saves its inner layers, the enorm and hnorm inputs and eh_proj's [n, 2h]
    input."""
    return model.mtp_depth * (inner_bytes + BF16 * tokens.replicated(4 * model.hidden_size))


DEFAULT_HF_PATTERN = "*E"
"""transformers' inner MTP pattern when a config names none."""

BRIDGE_LOSS_SCALE = 0.3
"""Megatron-Bridge's NemotronH provider weights the MTP loss 0.3 (Super and Ultra recipes)."""


def hf_config(model: ModelConfig, block_types: list[str]) -> dict[str, Any]:
    """``num_nextn_predict_layers`` counts stored blocks (what transformers, vLLM and the
    released checkpoints mean); how often they are applied and the loss weight travel under
    Megatron's names, which transformers keeps as plain attributes."""
    if not model.mtp_depth:
        return {}
    return {
        "num_nextn_predict_layers": model.mtp_stored_blocks,
        "mtp_layers_block_type": block_types,
        "mtp_hybrid_override_pattern": model.mtp_pattern,
        "mtp_num_layers": model.mtp_depth,
        "mtp_use_repeated_layer": model.mtp_stored_blocks < model.mtp_depth,
        "mtp_loss_scaling_factor": _loss_scale(model),
    }


def _loss_scale(model: ModelConfig) -> float:
    return model.mtp.loss_scale if model.mtp else 0.1


def from_hf(cfg: dict[str, Any], pattern: str) -> dict[str, Any] | None:
    """The ``model.mtp`` section; ``pattern`` is the inner pattern already mapped to symbols.

    ``num_nextn_predict_layers`` blocks are stored. A released config says nothing more, so
    one stored block reads as Megatron-Bridge reads it: shared (repeated), applied
    ``mtp_num_layers`` times (1 unless written), loss weight 0.3. Several stored blocks are
    applied once each."""
    blocks = cfg.get("num_nextn_predict_layers") or 0
    if not blocks:
        return None
    repeated = blocks == 1 and bool(cfg.get("mtp_use_repeated_layer", True))
    depth = int(cfg.get("mtp_num_layers") or blocks) if repeated else blocks
    return {
        "depth": depth,
        "pattern": pattern,
        "repeated": repeated,
        "loss_scale": _or_default(cfg.get("mtp_loss_scaling_factor"), BRIDGE_LOSS_SCALE),
    }


def _or_default(value: Any, default: float) -> Any:
    """Megatron writes None for "not set"; 0 is a real loss weight."""
    return default if value is None else value
