"""``*``: causal grouped-query self-attention (Ainslie et al. 2023, arXiv:2305.13245).

Nemotron-H and Nemotron 3 use no position embedding: the Mamba layers carry
position. Tensor parallelism splits q, k and v by columns (heads) and o by rows.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, ClassVar

from factory.spec.activations import BF16, FP32, TokenShards, prologue_bytes
from factory.spec.layer_type import (
    LayerFinding,
    LayerType,
    MegatronField,
    ProxyScale,
    layer_check,
    register_layer_type,
)
from factory.spec.rounding import nearest_multiple
from factory.spec.tensors import Init, TensorSpec, linear

if TYPE_CHECKING:
    from torch import nn

    from factory.schemas.blueprint import Blueprint
    from factory.schemas.model import AttentionConfig, ModelConfig

__all__ = ["SelfAttention"]


@register_layer_type
class SelfAttention(LayerType):
    symbol = "*"
    name = "attention"
    title = "attention"
    section = "attention"
    context_parallel = "kv_exchange"
    ends_period = True
    hf_block_type = "full_attention"
    hf_older_block_types = ("attention",)
    checkpoint_marker = "q_proj.weight"
    megatron_modules: ClassVar[
        dict[str, str]
    ] = {  # Megatron fuses Q, K and V into one column-parallel GEMM
        "mixer.q_proj": "self_attention.linear_qkv",
        "mixer.k_proj": "self_attention.linear_qkv",
        "mixer.v_proj": "self_attention.linear_qkv",
        "mixer.o_proj": "self_attention.linear_proj",
    }
    megatron_fields = (
        MegatronField("num_attention_heads", "model.attention.heads", lambda a: a.heads, absent=1),
        MegatronField("num_query_groups", "model.attention.kv_heads", lambda a: a.kv_heads),
        MegatronField("kv_channels", "model.attention.head_dim", lambda a: a.head_dim),
        MegatronField(
            "add_bias_linear", "model.attention.bias", lambda a: a.bias, share="agree", absent=False
        ),
    )

    @layer_check("model.attention_kv_heads")
    def kv_heads_divide_heads(self, bp: Blueprint) -> Iterator[LayerFinding]:
        """Query heads split evenly into key/value groups (GQA)."""
        att = bp.model.attention
        if att is not None and att.heads % att.kv_heads:
            yield (
                "model.attention.kv_heads",
                f"kv_heads={att.kv_heads} must divide attention heads ({att.heads})",
            )

    def mixer_tensors(self, model: ModelConfig, prefix: str) -> list[TensorSpec]:
        cfg: AttentionConfig = self.config(model)
        d, q, kv = model.hidden_size, cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
        normal = Init("normal")
        return [
            *linear(f"{prefix}.q_proj", d, q, bias=cfg.bias, tp="column", init=normal),
            *linear(f"{prefix}.k_proj", d, kv, bias=cfg.bias, tp="column", init=normal),
            *linear(f"{prefix}.v_proj", d, kv, bias=cfg.bias, tp="column", init=normal),
            *linear(f"{prefix}.o_proj", q, d, bias=cfg.bias, tp="row", init=Init("scaled_normal")),
        ]

    def extra_flops(self, model: ModelConfig, seq_len: int) -> int:
        """Causal: token i (1-based) attends to i keys, so the mean context is (s + 1) / 2;
        QK^T and PV each cost 2 * q_width * context per token."""
        cfg: AttentionConfig = self.config(model)
        return 2 * cfg.heads * cfg.head_dim * (seq_len + 1)

    def core_work(self, model: ModelConfig, seq_len: int) -> tuple[int, float]:
        """Flash attention reads Q, K and V and writes O once, whatever the context."""
        cfg: AttentionConfig = self.config(model)
        q, kv = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
        return self.extra_flops(model, seq_len), BF16 * (2 * q + 2 * kv)

    def core_exponentials(self, model: ModelConfig, seq_len: int) -> float:
        """One per query head and causal key: (s + 1) / 2 per token, as :meth:`extra_flops`
        counts; with head_dim 64 they take longer than QK^T and PV on Blackwell."""
        cfg: AttentionConfig = self.config(model)
        return cfg.heads * (seq_len + 1) / 2

    def elementwise_values(self, model: ModelConfig) -> int:
        """The block's norm and residual add, and RoPE on Q and K where the model uses it."""
        cfg: AttentionConfig = self.config(model)
        rope = model.position_embedding == "rope"
        return 5 * model.hidden_size + (
            2 * (cfg.heads + cfg.kv_heads) * cfg.head_dim if rope else 0
        )

    def cp_exchange_values(self, model: ModelConfig, cp: int) -> float:
        """Every rank's queries need the keys and values of the other ranks' chunks."""
        cfg: AttentionConfig = self.config(model)
        return 2 * cfg.kv_heads * cfg.head_dim * (cp - 1)

    def selective_recompute(self, model: ModelConfig, seq_len: int) -> tuple[int, int]:
        """core_attn: the attention core runs again."""
        return self.extra_flops(model, seq_len), 0

    def megatron_flops(self, model: ModelConfig, seq_len: int) -> int:
        cfg: AttentionConfig = self.config(model)
        h, s = model.hidden_size, seq_len
        q, kv = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
        return 4 * s * h * (q + kv) + 2 * s * s * q

    def activation_bytes(self, model: ModelConfig, tokens: TokenShards, recompute: str) -> float:
        """Flash attention saves Q, K, V and the output O (also o_proj's input), no s^2
        tensor; its fp32 log-sum-exp is the only thing core_attn recompute frees. KV heads
        are replicated when TP exceeds their number."""
        cfg: AttentionConfig = self.config(model)
        q = cfg.heads * cfg.head_dim
        kv_local = math.ceil(cfg.kv_heads / tokens.tp) * cfg.head_dim
        saved = prologue_bytes(tokens, model.hidden_size) + BF16 * (
            2 * tokens.sharded(q) + 2 * tokens.n * kv_local
        )
        if recompute == "none":
            saved += FP32 * tokens.sharded(cfg.heads)
        return saved

    def tp_rules(self, model: ModelConfig, tp: int) -> list[str]:
        """TP shards attention heads; KV groups are split or replicated evenly."""
        cfg: AttentionConfig = self.config(model)
        problems = []
        if cfg.heads % tp:
            problems.append(f"tp={tp} must divide attention heads ({cfg.heads})")
        if cfg.kv_heads % tp and tp % cfg.kv_heads:
            problems.append(
                f"attention kv_heads ({cfg.kv_heads}) must be a multiple or divisor of tp={tp}"
            )
        return problems

    def tp_whole_linears(self, model: ModelConfig, tp: int) -> tuple[str, ...]:
        """Megatron replicates KV heads when TP exceeds them: every rank holds k and v whole."""
        return ("k_proj", "v_proj") if self.config(model).kv_heads < tp else ()

    def localize_for_tp(self, mixer: nn.Module, tp: int, rank: int) -> dict[str, tuple[int, int]]:
        kept = {}
        if mixer.kv_heads < tp:
            head = rank // (tp // mixer.kv_heads)  # the KV head of all this rank's queries
            kept = dict.fromkeys(("k_proj", "v_proj"), (head * mixer.head_dim, mixer.head_dim))
        mixer.heads, mixer.kv_heads = mixer.heads // tp, max(mixer.kv_heads // tp, 1)
        return kept

    def shrink(self, section: dict[str, Any], source: AttentionConfig, proxy: ProxyScale) -> None:
        """Keep r = heads / kv_heads: kv_heads 1 if r >= 8 else min(kv_heads, 2); head_dim
        the multiple of 8 nearest the scaled query width over the proxy's heads."""
        ratio = source.heads // source.kv_heads
        kv_heads = 1 if ratio >= 8 else min(source.kv_heads, 2)
        heads = ratio * kv_heads
        head_dim = nearest_multiple(source.heads * source.head_dim * proxy.scale / heads, 8)
        section.update(heads=heads, kv_heads=kv_heads, head_dim=head_dim)

    def hf_refusals(self, model: ModelConfig) -> list[str]:
        if self.config(model).bias:
            return ["HF NemotronH attention has no biases (model.attention.bias)"]
        return []

    def hf_config(self, model: ModelConfig) -> dict[str, Any]:
        cfg: AttentionConfig = self.config(model)
        return {
            "num_attention_heads": cfg.heads,
            "num_key_value_heads": cfg.kv_heads,
            "head_dim": cfg.head_dim,
            "attention_bias": False,
        }

    def from_hf(self, cfg: dict[str, Any]) -> dict[str, Any]:
        return {
            "heads": cfg["num_attention_heads"],
            "kv_heads": cfg["num_key_value_heads"],
            # Nemotron-H and Nano-v2 configs spell it attention_head_dim, which transformers
            # ignores for its own default of 128; Megatron-Bridge reads either.
            "head_dim": cfg.get("head_dim") or cfg.get("attention_head_dim") or 128,
        }
