"""Blueprint <-> Hugging Face ``NemotronHConfig`` (``config.json``), torch-free.

The mapping follows transformers' NemotronH and the released Nemotron 3
configs (``docs/architecture.md``). Each layer type contributes its own fields
and its own refusals (``LayerType.hf_config``, ``hf_refusals``, ``from_hf`` in
``factory.layers``); a layer type NemotronH has no block for, or a feature it
cannot express (RoPE, attention biases, gated MLPs, softmax routing, an upper
dt clamp, MoE without a shared expert), is refused with a reason instead of
exported wrongly.
"""

from __future__ import annotations

from typing import Any

from factory.layers import mtp
from factory.schemas.blueprint import Blueprint
from factory.schemas.model import ModelConfig
from factory.spec.layer_type import LAYER_TYPES, layer_type

__all__ = ["ExportError", "blueprint_fields_from_hf", "hf_block_types", "hf_config"]


class ExportError(ValueError):
    """The blueprint uses a feature the target format cannot represent."""


def _used_types(model: ModelConfig) -> list[str]:
    used = set(model.parsed_pattern.main + model.mtp_pattern)
    return [symbol for symbol in LAYER_TYPES if symbol in used]


def _refusals(bp: Blueprint) -> list[str]:
    m = bp.model
    out = []
    if m.position_embedding != "none":
        out.append("HF NemotronH applies no position embedding (model.position_embedding: rope)")
    for symbol in _used_types(m):
        out += layer_type(symbol).hf_refusals(m)
    return out


def hf_block_types(pattern: str) -> list[str]:
    """NemotronH's ``layers_block_type`` entries of a pattern (all types have one)."""
    return [str(layer_type(symbol).hf_block_type) for symbol in pattern]


def hf_config(bp: Blueprint, dtype: str = "float32") -> dict[str, Any]:
    """The ``config.json`` of ``bp``; raises ExportError for what HF cannot express."""
    refusals = _refusals(bp)
    if refusals:
        raise ExportError("cannot export to Hugging Face NemotronH: " + "; ".join(refusals))
    m = bp.model
    main = m.parsed_pattern.main
    cfg: dict[str, Any] = {
        "architectures": ["NemotronHForCausalLM"],
        "model_type": "nemotron_h",
        "torch_dtype": dtype,
        "vocab_size": m.vocab_size,
        "hidden_size": m.hidden_size,
        "num_hidden_layers": len(main),
        "layers_block_type": hf_block_types(main),
        "hybrid_override_pattern": main,
        "tie_word_embeddings": m.tie_embeddings,
        "max_position_embeddings": m.max_seq_len,
        "layer_norm_epsilon": m.norm_eps,
        "initializer_range": m.init.std,
        "residual_in_fp32": False,
        "rescale_prenorm_residual": True,
        "use_cache": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
        "mlp_hidden_act": "relu2",
    }
    # Earlier layer types win a shared key: the dense MLP's intermediate_size over the MoE's
    # fallback (NemotronH needs one even without dense MLP layers).
    for symbol in _used_types(m):
        for key, value in layer_type(symbol).hf_config(m).items():
            cfg.setdefault(key, value)
    cfg.setdefault("mlp_bias", False)
    cfg.setdefault("intermediate_size", 1)
    return cfg | mtp.hf_config(m, hf_block_types(m.mtp_pattern))


def _symbol_of(block_type: str) -> str:
    for symbol, kind in LAYER_TYPES.items():
        if block_type == kind.hf_block_type or block_type in kind.hf_older_block_types:
            return symbol
    raise ExportError(f"unknown NemotronH layer type {block_type!r}")


def _mtp_pattern_from_hf(cfg: dict[str, Any]) -> str:
    """The inner MTP pattern, empty without MTP. transformers fills ``mtp_layers_block_type``
    with ``["full_attention", "moe"]`` even when MTP is off, so it counts only with
    ``num_nextn_predict_layers`` > 0. Megatron-Bridge writes ``mtp_hybrid_override_pattern``;
    like transformers, it wins over a block-type list that is only that default."""
    if not cfg.get("num_nextn_predict_layers"):
        return ""
    listed = "".join(_symbol_of(t) for t in cfg.get("mtp_layers_block_type") or [])
    written = cfg.get("mtp_hybrid_override_pattern")
    if written and listed in ("", mtp.DEFAULT_HF_PATTERN):
        return str(written)
    return listed or mtp.DEFAULT_HF_PATTERN


def blueprint_fields_from_hf(cfg: dict[str, Any]) -> dict[str, Any]:
    """The ``model`` section of a blueprint that reproduces an HF NemotronH config."""
    layers = cfg.get("layers_block_type") or cfg.get("layer_types")
    pattern = "".join(_symbol_of(t) for t in layers) if layers else cfg["hybrid_override_pattern"]
    model: dict[str, Any] = {
        "pattern": pattern,
        "hidden_size": cfg["hidden_size"],
        "vocab_size": cfg["vocab_size"],
        "max_seq_len": cfg.get("max_position_embeddings", 4096),
        "norm_eps": cfg.get("layer_norm_epsilon", 1e-5),
        "tie_embeddings": cfg.get("tie_word_embeddings", False),
        "init": {"std": cfg.get("initializer_range", 0.02)},
    }
    mtp_pattern = _mtp_pattern_from_hf(cfg)
    for symbol, kind in LAYER_TYPES.items():
        if symbol in pattern + mtp_pattern and kind.section is not None:
            section = kind.from_hf(cfg)
            if section is not None:
                model[kind.section] = section
    mtp_section = mtp.from_hf(cfg, mtp_pattern)
    if mtp_section is not None:
        model["mtp"] = mtp_section
    return model
