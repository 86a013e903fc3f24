"""Blueprint <-> Hugging Face ``NemotronHConfig`` (``config.json``), torch-free.

The mapping follows transformers' NemotronH and the released Nemotron 3
configs (architecture.md §2, §6.1). Features the HF model cannot express
(RoPE, attention biases, gated MLPs, softmax routing, an upper dt clamp, MoE
without a shared expert) are refused with a reason instead of exported wrongly.

One subtlety: transformers clamps dt from below at ``time_step_min``, while
Megatron clamps at ``dt_limit_min`` (0 by default). The export writes
``time_step_min = dt_limit_min`` so that HF computes what we trained; the
import maps it back the same way.
"""

from __future__ import annotations

from typing import Any

from factory.schemas.blueprint import Blueprint
from factory.schemas.pattern import LAYER_SYMBOLS

__all__ = ["HF_LAYER_TYPES", "ExportError", "blueprint_fields_from_hf", "hf_config"]

HF_LAYER_TYPES = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}
_SYMBOL_OF = {name: symbol for symbol, name in HF_LAYER_TYPES.items()}
_SYMBOL_OF.update({"mamba": "M", "attention": "*"})  # older transformers names


class ExportError(ValueError):
    """The blueprint uses a feature the target format cannot represent."""


def _refusals(bp: Blueprint) -> list[str]:
    m = bp.model
    out = []
    if m.position_embedding != "none":
        out.append("HF NemotronH applies no position embedding (model.position_embedding: rope)")
    if m.attention is not None and m.attention.bias:
        out.append("HF NemotronH attention has no biases (model.attention.bias)")
    if m.mlp is not None and m.mlp.activation != "relu2":
        out.append("HF NemotronH MLPs are non-gated relu2 (model.mlp.activation)")
    if m.mamba is not None and m.mamba.dt_limit_max is not None:
        out.append("HF NemotronH has no upper dt clamp (model.mamba.dt_limit_max)")
    if m.moe is not None:
        if m.moe.activation != "relu2":
            out.append("HF NemotronH experts are non-gated relu2 (model.moe.activation)")
        if m.moe.router.score_function != "sigmoid":
            out.append("HF NemotronH routes with sigmoid scores (model.moe.router.score_function)")
        if not m.moe.shared_expert_intermediate_size:
            out.append("HF NemotronH MoE always has a shared expert")
    return out


def hf_config(bp: Blueprint, dtype: str = "float32") -> dict[str, Any]:
    """The ``config.json`` of ``bp``; raises ExportError for what HF cannot express."""
    refusals = _refusals(bp)
    if refusals:
        raise ExportError("cannot export to Hugging Face NemotronH: " + "; ".join(refusals))
    m = bp.model
    main = m.layout.main
    mamba, attention, mlp, moe = m.mamba, m.attention, m.mlp, m.moe
    cfg: dict[str, Any] = {
        "architectures": ["NemotronHForCausalLM"],
        "model_type": "nemotron_h",
        "torch_dtype": dtype,
        "vocab_size": m.vocab_size,
        "hidden_size": m.hidden_size,
        "num_hidden_layers": len(main),
        "layers_block_type": [HF_LAYER_TYPES[c] for c in main],
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
        "mlp_bias": mlp.bias if mlp is not None else False,
        "intermediate_size": (
            mlp.intermediate_size if mlp else (moe.expert_intermediate_size if moe else 1)
        ),
    }
    if attention is not None:
        cfg |= {
            "num_attention_heads": attention.heads,
            "num_key_value_heads": attention.kv_heads,
            "head_dim": attention.head_dim,
            "attention_bias": False,
        }
    if mamba is not None:
        cfg |= {
            "mamba_num_heads": mamba.heads,
            "mamba_head_dim": mamba.head_dim,
            "ssm_state_size": mamba.state_size,
            "n_groups": mamba.groups,
            "conv_kernel": mamba.conv_kernel,
            "chunk_size": mamba.chunk_size,
            "expand": 2,
            "mamba_hidden_act": "silu",
            "use_conv_bias": mamba.conv_bias,
            "use_bias": mamba.bias,
            "mamba_proj_bias": mamba.bias,
            "time_step_min": mamba.dt_limit_min,
            "time_step_max": mamba.dt_max,
            "time_step_floor": mamba.dt_init_floor,
        }
    if moe is not None:
        router = moe.router
        cfg |= {
            "n_routed_experts": moe.num_experts,
            "num_experts_per_tok": moe.top_k,
            "moe_intermediate_size": moe.expert_intermediate_size,
            "moe_shared_expert_intermediate_size": moe.shared_expert_intermediate_size,
            "n_shared_experts": 1,
            "moe_latent_size": moe.latent_size,
            "moe_shared_expert_overlap": False,
            "routed_scaling_factor": router.scaling_factor,
            "n_group": router.num_groups,
            "topk_group": router.group_top_k,
            "norm_topk_prob": router.normalize_top_k,
        }
    if m.mtp_depth:
        cfg |= {
            "num_nextn_predict_layers": m.mtp_stored_blocks,
            "mtp_layers_block_type": [HF_LAYER_TYPES[c] for c in m.mtp_pattern],
            "mtp_hybrid_override_pattern": m.mtp_pattern,
        }
    return cfg


def blueprint_fields_from_hf(cfg: dict[str, Any]) -> dict[str, Any]:
    """The ``model`` section of a blueprint that reproduces an HF NemotronH config."""
    layers = cfg.get("layers_block_type") or cfg.get("layer_types")
    pattern = "".join(_SYMBOL_OF[t] for t in layers) if layers else cfg["hybrid_override_pattern"]
    model: dict[str, Any] = {
        "pattern": pattern,
        "hidden_size": cfg["hidden_size"],
        "vocab_size": cfg["vocab_size"],
        "max_seq_len": cfg.get("max_position_embeddings", 4096),
        "norm_eps": cfg.get("layer_norm_epsilon", 1e-5),
        "tie_embeddings": cfg.get("tie_word_embeddings", False),
        "init": {"std": cfg.get("initializer_range", 0.02)},
    }
    used = set(pattern)
    if "*" in used:
        model["attention"] = {
            "heads": cfg["num_attention_heads"],
            "kv_heads": cfg["num_key_value_heads"],
            "head_dim": cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
        }
    if "M" in used:
        floor = cfg.get("time_step_min", 0.001)
        model["mamba"] = {
            "heads": cfg["mamba_num_heads"],
            "head_dim": cfg["mamba_head_dim"],
            "state_size": cfg.get("ssm_state_size", 128),
            "groups": cfg.get("n_groups", 8),
            "conv_kernel": cfg.get("conv_kernel", 4),
            "chunk_size": cfg.get("chunk_size", 128),
            "dt_min": floor if floor > 0 else 0.001,
            "dt_max": cfg.get("time_step_max", 0.1),
            "dt_init_floor": cfg.get("time_step_floor", 1e-4),
            "dt_limit_min": floor,  # what transformers clamps dt to
            "conv_bias": cfg.get("use_conv_bias", True),
            "bias": cfg.get("use_bias", False),
        }
    if "-" in used:
        model["mlp"] = {
            "intermediate_size": cfg.get("intermediate_size", 1),
            "bias": cfg.get("mlp_bias", False),
        }
    if "E" in used:
        model["moe"] = {
            "num_experts": cfg["n_routed_experts"],
            "top_k": cfg["num_experts_per_tok"],
            "expert_intermediate_size": cfg["moe_intermediate_size"],
            "shared_expert_intermediate_size": cfg.get("moe_shared_expert_intermediate_size", 0),
            "latent_size": cfg.get("moe_latent_size"),
            "router": {
                "score_function": "sigmoid",
                "expert_bias": True,
                "normalize_top_k": cfg.get("norm_topk_prob", True),
                "scaling_factor": cfg.get("routed_scaling_factor", 1.0),
                "num_groups": cfg.get("n_group", 1),
                "group_top_k": cfg.get("topk_group", 1),
            },
        }
    blocks = cfg.get("num_nextn_predict_layers", 0)
    if blocks:
        inner = cfg.get("mtp_layers_block_type") or ["full_attention", "moe"]
        model["mtp"] = {
            "depth": blocks,
            "pattern": "".join(_SYMBOL_OF[t] for t in inner),
            "repeated": False,
        }
    assert set(pattern) <= set(LAYER_SYMBOLS)
    return model
