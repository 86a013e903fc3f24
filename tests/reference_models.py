"""Reference models built straight from the published configurations, not from presets.

The widths are those of ``docs/architecture.md`` ('Nemotron 3 Nano', 'Nemotron 3 Super',
'Nemotron 3 Ultra'). Tests compare the planner against published numbers through these,
so they stay independent of the YAML presets.
"""

from __future__ import annotations

from factory.schemas.model import ModelConfig

NANO_PATTERN = "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME"
SUPER_PATTERN = (
    "MEMEMEM*EMEMEMEM*EMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEM*EMEMEMEME"
)
ULTRA_PATTERN = (
    "MEMEMEM*EMEMEM*EMEMEMEM*EMEMEMEM*EMEMEM*EMEMEMEM*EMEMEMEM*EMEMEM*EMEMEMEM*EMEMEMEM*EMEMEM"
    "*EMEMEMEM*EMEMEMEME"
)
VOCAB = 131072


def nano(**overrides: object) -> ModelConfig:
    """``docs/architecture.md``, 'Nemotron 3 Nano' (the released ``config.json``)."""
    cfg: dict[str, object] = {
        "pattern": NANO_PATTERN,
        "hidden_size": 2688,
        "vocab_size": VOCAB,
        "max_seq_len": 262144,
        "attention": {"heads": 32, "kv_heads": 2, "head_dim": 128},
        "mamba": {"heads": 64, "head_dim": 64},
        "moe": {
            "num_experts": 128,
            "top_k": 6,
            "expert_intermediate_size": 1856,
            "shared_expert_intermediate_size": 3712,
        },
    }
    return ModelConfig.model_validate({**cfg, **overrides})


def super_(pattern: str = SUPER_PATTERN, mtp: dict[str, object] | None = None) -> ModelConfig:
    """``docs/architecture.md``, 'Nemotron 3 Super' (a '/*E/*E' suffix adds two MTP depths)."""
    return ModelConfig.model_validate(
        {
            "pattern": pattern,
            "mtp": mtp,
            "hidden_size": 4096,
            "vocab_size": VOCAB,
            "max_seq_len": 262144,
            "attention": {"heads": 32, "kv_heads": 2, "head_dim": 128},
            "mamba": {"heads": 128, "head_dim": 64},
            "moe": {
                "num_experts": 512,
                "top_k": 22,
                "expert_intermediate_size": 2688,
                "shared_expert_intermediate_size": 5376,
                "latent_size": 1024,
            },
        }
    )


def ultra() -> ModelConfig:
    """``docs/architecture.md``, 'Nemotron 3 Ultra' (vocab 131072 assumed, as in Nano and Super)."""
    return ModelConfig.model_validate(
        {
            "pattern": ULTRA_PATTERN,
            "hidden_size": 8192,
            "vocab_size": VOCAB,
            "max_seq_len": 262144,
            "attention": {"heads": 64, "kv_heads": 2, "head_dim": 128},
            "mamba": {"heads": 256, "head_dim": 64},
            "moe": {
                "num_experts": 512,
                "top_k": 22,
                "expert_intermediate_size": 5120,
                "shared_expert_intermediate_size": 10240,
                "latent_size": 2048,
            },
        }
    )
