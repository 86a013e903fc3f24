"""The architectures of the published throughput rows, as blueprint ``model`` sections.

Each entry is the model's public configuration (its Hugging Face ``config.json`` or the
Megatron-Bridge provider named in ``docs/performance.md``), written with factory's layer
types: a dense Transformer is ``*-`` repeated (attention, then an MLP), a MoE one ``*E``.
What the schema cannot say is approximated and listed in ``APPROXIMATIONS``; models
it cannot express at all are in ``SKIPPED`` with the reason.
"""

from __future__ import annotations

from typing import Any

__all__ = ["APPROXIMATIONS", "FAMILIES", "SKIPPED", "family_of", "model_section"]


def _attention(heads: int, kv: int, head_dim: int, bias: bool = False) -> dict[str, Any]:
    return {"heads": heads, "kv_heads": kv, "head_dim": head_dim, "bias": bias}


def _dense(
    layers: int, hidden: int, att: dict, ff: int, vocab: int, act: str = "swiglu"
) -> dict[str, Any]:
    return {
        "pattern": "*-" * layers,
        "hidden_size": hidden,
        "vocab_size": vocab,
        "position_embedding": "rope",
        "attention": att,
        "mlp": {"intermediate_size": ff, "activation": act},
    }


def _moe(
    layers: int,
    hidden: int,
    att: dict,
    experts: int,
    top_k: int,
    ff: int,
    vocab: int,
    score: str = "softmax",
    shared: int = 0,
) -> dict[str, Any]:
    return {
        "pattern": "*E" * layers,
        "hidden_size": hidden,
        "vocab_size": vocab,
        "position_embedding": "rope",
        "attention": att,
        "moe": {
            "num_experts": experts,
            "top_k": top_k,
            "expert_intermediate_size": ff,
            "shared_expert_intermediate_size": shared,
            "activation": "swiglu",
            "router": {"score_function": score, "expert_bias": False, "aux_loss": "aux_loss"},
        },
    }


_LLAMA3_70B = _dense(80, 8192, _attention(64, 8, 128), 28672, 128256)
_LLAMA3_8B = _dense(32, 4096, _attention(32, 8, 128), 14336, 128256)
_NEMOTRON4_340B = _dense(96, 18432, _attention(96, 8, 192), 73728, 256000, "relu2")
_MAVERICK = _moe(24, 5120, _attention(40, 8, 128), 128, 1, 8192, 202048, "sigmoid", 8192)
_MAVERICK["pattern"] = "*-*E" * 24
_MAVERICK["mlp"] = {"intermediate_size": 16384, "activation": "swiglu"}
_NEMOTRON_H_56B = {
    "pattern": "M-M-M-M*-" + "M-M-M-M-M*-" * 9 + "M-M-M-M-M-",
    "hidden_size": 8192,
    "vocab_size": 131072,
    "attention": _attention(64, 8, 128),
    "mamba": {"heads": 256, "head_dim": 64, "state_size": 256, "groups": 8},
    "mlp": {"intermediate_size": 32768, "activation": "relu2"},
}

FAMILIES: dict[str, tuple[str, dict[str, Any] | None]] = {
    # table name: (family, model section; None: the shipped ``nano`` preset's)
    "Nemotron 3 Nano": ("nemotron-3", None),
    "Nemotron-H 56B": ("nemotron-h", _NEMOTRON_H_56B),
    "Llama2 7B": ("llama", _dense(32, 4096, _attention(32, 32, 128), 11008, 32000)),
    "Llama2 13B": ("llama", _dense(40, 5120, _attention(40, 40, 128), 13824, 32000)),
    "Llama2 70B": ("llama", _dense(80, 8192, _attention(64, 8, 128), 28672, 32000)),
    "Llama3 8B": ("llama", _LLAMA3_8B),
    "Llama3.1 8B": ("llama", _LLAMA3_8B),
    "Llama3 70B": ("llama", _LLAMA3_70B),
    "Llama3.1 70B": ("llama", _LLAMA3_70B),
    "Llama3.1 405B": ("llama", _dense(126, 16384, _attention(128, 8, 128), 53248, 128256)),
    "Llama4 Maverick 400B-A17B": ("llama", _MAVERICK),
    "Nemotron-4 15B": (
        "nemotron-4",
        _dense(32, 6144, _attention(48, 8, 128), 24576, 256000, "relu2"),
    ),
    "Nemotron-4 340B": ("nemotron-4", _NEMOTRON4_340B),
    "Nemotron-340B": ("nemotron-4", _NEMOTRON4_340B),
    "GPT3-175B": ("gpt3", _dense(96, 12288, _attention(96, 96, 128), 49152, 50304, "relu2")),
    "Qwen3 30B-A3B": ("qwen3-moe", _moe(48, 2048, _attention(32, 4, 128), 128, 8, 768, 151936)),
    "Qwen3 235B-A22B": ("qwen3-moe", _moe(94, 4096, _attention(64, 4, 128), 128, 8, 1536, 151936)),
    "GPT-OSS 120B": (
        "gpt-oss",
        _moe(36, 2880, _attention(64, 8, 64, bias=True), 128, 4, 2880, 201088),
    ),
    "Mixtral 8x7B": ("mixtral", _moe(32, 4096, _attention(32, 8, 128), 8, 2, 14336, 32000)),
    "Grok-1 314B": ("grok", _moe(64, 6144, _attention(48, 8, 128), 8, 2, 32768, 131072)),
}

APPROXIMATIONS = {
    "llama": "RoPE scaling ignored; Llama 4's chunked attention and NoPE layers run as full causal attention",
    "gpt-oss": "sliding-window layers and attention sinks run as full causal attention",
    "gpt3": "GELU MLP as a non-gated relu2 MLP (same GEMMs); learned positions as RoPE",
    "grok": "gated GELU experts as SwiGLU (same GEMMs)",
    "nemotron-4": "relu2 MLP as published",
    "nemotron-h": "none",
    "nemotron-3": "none",
    "qwen3-moe": "QK-norm left out (elementwise)",
    "mixtral": "sliding window off, as in the released config",
}

SKIPPED = {
    "DeepSeek-V3": "multi-head latent attention (MLA): no layer type for it",
    "DeepSeek-V4-Flash": "MLA and an architecture not described in the sources read",
    "Kimi K2": "multi-head latent attention (MLA): no layer type for it",
    "GPT3-5B": "dimensions not given by the sources read",
    "GPT3-20B": "dimensions not given by the sources read",
    "Nemotron-8B": "dimensions not given by the sources read",
    "Nemotron-22B": "dimensions not given by the sources read",
}


def family_of(model: str) -> str:
    return FAMILIES[model][0]


def model_section(model: str, base: dict[str, Any], seq_len: int) -> dict[str, Any]:
    """The ``model`` section for a table model: ``base``'s (the nano preset's) or ours."""
    section = FAMILIES[model][1]
    out = dict(base if section is None else section)
    out["max_seq_len"] = max(seq_len, out.get("max_seq_len", 0))
    return out
