"""``M``: the Mamba-2 mixer (Dao & Gu 2024, "Transformers are SSMs", arXiv:2405.21060).

in_proj packs [z, x, B, C, dt]; a depthwise causal conv1d runs over x, B and C;
the chunked SSD scan with a per-head D skip; a gated RMSNorm per group; out_proj.
Tensor parallelism splits everything by heads and groups (Megatron's
``MambaMixer``), so in_proj's five packed segments split one by one.
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
from factory.spec.tensors import Init, Role, Split, TensorSpec, conv, linear, norm, vector

if TYPE_CHECKING:
    from torch import nn

    from factory.schemas.blueprint import Blueprint
    from factory.schemas.model import MambaConfig, ModelConfig

__all__ = ["MEGATRON_MIXER_DEFAULTS", "Mamba"]


# MambaMixer's constructor defaults (megatron/core/ssm/mamba_mixer.py, 0.16.1): the mixer
# spec passes none of these, so only these values are expressible in a Megatron recipe.
MEGATRON_MIXER_DEFAULTS = {
    "conv_kernel": 4,
    "chunk_size": 128,
    "dt_min": 0.001,
    "dt_max": 0.1,
    "dt_init_floor": 1e-4,
    "dt_limit_min": 0.0,
    "dt_limit_max": None,
    "conv_bias": True,
    "bias": False,
}


@register_layer_type
class Mamba(LayerType):
    symbol = "M"
    name = "mamba"
    title = "Mamba-2"
    section = "mamba"
    context_parallel = "heads_all_to_all"
    core_coefficient = "scan"
    hf_block_type = "linear_attention"
    hf_older_block_types = ("mamba",)
    checkpoint_marker = "A_log"
    megatron_modules: ClassVar[dict[str, str]] = {
        "mixer.in_proj": "mixer.in_proj",
        "mixer.out_proj": "mixer.out_proj",
    }
    megatron_fields = (
        MegatronField("mamba_num_heads", "model.mamba.heads", lambda s: s.heads),
        MegatronField("mamba_head_dim", "model.mamba.head_dim", lambda s: s.head_dim),
        MegatronField("mamba_state_dim", "model.mamba.state_size", lambda s: s.state_size),
        MegatronField("mamba_num_groups", "model.mamba.groups", lambda s: s.groups),
    )

    @layer_check("model.mamba_groups")
    def groups_divide_heads(self, bp: Blueprint) -> Iterator[LayerFinding]:
        """Mamba heads split evenly into B/C groups (Megatron asserts nheads % ngroups == 0)."""
        mamba = bp.model.mamba
        if mamba is not None and mamba.heads % mamba.groups:
            yield (
                "model.mamba.groups",
                f"mamba groups={mamba.groups} must divide mamba heads ({mamba.heads})",
            )

    @layer_check("model.mamba_in_proj_alignment")
    def in_proj_alignment(self, bp: Blueprint) -> Iterator[LayerFinding]:
        """Quantised GEMMs need the Mamba in_proj width to be a multiple of 16.

        Megatron asserts (2*d_inner + 2*groups*state + heads) % 16 == 0 only
        under FP8/FP4, where Transformer Engine's kernels need 16-aligned
        dimensions; in BF16 any width works, so nothing is reported.
        """
        mamba, recipes = bp.model.mamba, bp.precision.low_precision_recipes
        if mamba is None or not self.used_by(bp.model) or not recipes:
            return
        width = mamba.in_proj_dim
        if width % 16:
            yield (
                "model.mamba.heads",
                f"mamba in_proj width 2*d_inner + 2*groups*state + heads = 2*{mamba.d_inner} + "
                f"2*{mamba.groups}*{mamba.state_size} + {mamba.heads} = {width} must be a "
                f"multiple of 16 for {'/'.join(recipes)} GEMMs ({width} % 16 = {width % 16})",
            )

    def mixer_tensors(self, model: ModelConfig, prefix: str) -> list[TensorSpec]:
        cfg: MambaConfig = self.config(model)
        d, heads = model.hidden_size, cfg.heads
        bc = cfg.groups * cfg.state_size
        by_heads = Split("heads", 0)
        return [
            vector(
                f"{prefix}.dt_bias",
                heads,
                Role.SSM,
                Init("dt_bias", (cfg.dt_min, cfg.dt_max, cfg.dt_init_floor)),
                by_heads,
            ),
            vector(f"{prefix}.A_log", heads, Role.SSM, Init("a_log"), by_heads),
            vector(f"{prefix}.D", heads, Role.SSM, Init("ones"), by_heads),
            *linear(
                f"{prefix}.in_proj",
                d,
                cfg.in_proj_dim,
                bias=cfg.bias,
                tp="heads",
                init=Init("normal"),
                segments=(cfg.d_inner, cfg.d_inner, bc, bc, heads),
            ),
            *conv(
                f"{prefix}.conv1d",
                cfg.conv_dim,
                cfg.conv_kernel,
                bias=cfg.conv_bias,
                segments=(cfg.d_inner, bc, bc),
            ),
            norm(f"{prefix}.norm.weight", cfg.d_inner, by_heads),
            *linear(
                f"{prefix}.out_proj",
                cfg.d_inner,
                d,
                bias=cfg.bias,
                tp="row",
                init=Init("scaled_normal"),
            ),
        ]

    def extra_flops(self, model: ModelConfig, seq_len: int) -> int:
        """The SSD scan as mamba_ssm's chunked kernels execute it, per token, with chunk
        length Q: 2*Q*N*groups for the C.B^T block of its chunk row (computed whole, then
        masked), 2*Q*d_inner to apply it to the chunk's x, and 2*N*d_inner each for the
        chunk-end state (x outer B) and the off-diagonal output (C . state). The state
        passing between chunks is elementwise and O(1/Q) per token, so it is left out."""
        cfg: MambaConfig = self.config(model)
        n, chunk = cfg.state_size, min(cfg.chunk_size, seq_len)
        return 2 * chunk * n * cfg.groups + 2 * chunk * cfg.d_inner + 4 * n * cfg.d_inner

    def core_work(self, model: ModelConfig, seq_len: int) -> tuple[int, float]:
        """The conv1d and the chunked scan read in_proj's output, write and read the conv's,
        write y, and write and read every chunk's fp32 state (d_inner x N per chunk)."""
        cfg: MambaConfig = self.config(model)
        chunk = min(cfg.chunk_size, seq_len)
        values = cfg.in_proj_dim + 2 * cfg.conv_dim + cfg.d_inner
        states = 2 * FP32 * cfg.d_inner * cfg.state_size / chunk
        return self.extra_flops(model, seq_len), BF16 * values + states

    def elementwise_values(self, model: ModelConfig) -> int:
        """The block's norm and residual add, and the gated RMSNorm (reads y and z, writes)."""
        cfg: MambaConfig = self.config(model)
        return 5 * model.hidden_size + 3 * cfg.d_inner

    def cp_exchange_values(self, model: ModelConfig, cp: int) -> float:
        """All-to-alls turn sequence shards into head shards before the conv (in_proj's
        output) and back after the scan (y): each rank keeps 1/cp of both."""
        cfg: MambaConfig = self.config(model)
        return (cfg.in_proj_dim + cfg.d_inner) * (cp - 1) / cp

    def megatron_flops(self, model: ModelConfig, seq_len: int) -> int:
        """Megatron-LM's hybrid formula, which takes d_inner = 2h whatever heads x head_dim."""
        cfg: MambaConfig = self.config(model)
        h, s = model.hidden_size, seq_len
        d_in, n = 2 * h, cfg.state_size
        in_proj = 2 * s * h * (2 * d_in + 2 * cfg.groups * n + cfg.heads)
        return in_proj + 7 * s * d_in * n + 2 * s * d_in * h

    def activation_bytes(self, model: ModelConfig, tokens: TokenShards, recompute: str) -> float:
        """Megatron's memory-efficient path keeps the packed in_proj output and recomputes
        the conv and the scan in backward; the gated norm keeps an fp32 rstd per group and
        out_proj its input (in the recipe's format). Mamba has no selective-recompute module:
        selective = none."""
        cfg: MambaConfig = self.config(model)
        return (
            prologue_bytes(tokens, model.hidden_size)
            + BF16 * tokens.sharded(cfg.in_proj_dim)
            + FP32 * tokens.sharded(cfg.groups)
            + tokens.gemm_input * tokens.sharded(cfg.d_inner)
        )

    def tp_rules(self, model: ModelConfig, tp: int) -> list[str]:
        """TP shards Mamba heads and groups, so it must divide both."""
        cfg: MambaConfig = self.config(model)
        return [
            f"tp={tp} must divide mamba {what} ({count})"
            for what, count in (("heads", cfg.heads), ("groups", cfg.groups))
            if count % tp
        ]

    def cp_rules(self, model: ModelConfig, tp: int, cp: int) -> list[str]:
        """Mamba's context parallelism splits each rank's heads and groups over CP
        (Megatron-Core's ``MambaContextParallel``)."""
        cfg: MambaConfig = self.config(model)
        out = []
        if cfg.heads % tp == 0 and (cfg.heads // tp) % cp:
            out.append(
                f"mamba heads/tp = {cfg.heads}/{tp} = {cfg.heads // tp} must be divisible "
                f"by cp={cp}"
            )
        if cfg.groups % tp == 0:
            local = cfg.groups // tp
            if (local < cp and cp % local) or (local >= cp and local % cp):
                out.append(
                    f"mamba groups/tp = {cfg.groups}/{tp} = {local} and cp={cp} must divide "
                    "one another"
                )
        return out

    def localize_for_tp(self, mixer: nn.Module, tp: int, rank: int) -> dict[str, tuple[int, int]]:
        mixer.heads, mixer.groups = mixer.heads // tp, mixer.groups // tp
        mixer.norm.groups //= tp
        return {}

    def megatron_refusals(self, model: ModelConfig) -> list[tuple[str, str]]:
        cfg: MambaConfig = self.config(model)
        return [
            (
                f"model.mamba.{name}",
                f"MambaMixer's {name} is fixed at {default} by the layer spec (no config "
                f"field), got {getattr(cfg, name)}",
            )
            for name, default in MEGATRON_MIXER_DEFAULTS.items()
            if getattr(cfg, name) != default
        ]

    def shrink(self, section: dict[str, Any], source: MambaConfig, proxy: ProxyScale) -> None:
        """head_dim, state and chunk 16, at most 2 groups; heads the multiple of groups
        nearest d_inner * s / 16 (of lcm(groups, 16) when quantized: in_proj must stay
        16-aligned for the 1x16 and 16x16 NVFP4 tiles)."""
        groups = min(source.groups, 2)
        step = math.lcm(groups, 16) if proxy.quantized else groups
        heads = nearest_multiple(source.d_inner * proxy.scale / 16, step)
        section.update(heads=heads, head_dim=16, groups=groups, state_size=16, chunk_size=16)

    def hf_refusals(self, model: ModelConfig) -> list[str]:
        if self.config(model).dt_limit_max is not None:
            return ["HF NemotronH has no upper dt clamp (model.mamba.dt_limit_max)"]
        return []

    def hf_config(self, model: ModelConfig) -> dict[str, Any]:
        """time_step_min is the lower bound of the dt init, as in the released configs:
        transformers takes its log in ``_init_weights``, so 0 breaks ``from_config``.
        transformers also clamps dt from below at time_step_min, where Megatron (which
        trained every released checkpoint) clamps at dt_limit_min: time_step_limit
        (transformers' own field, saved as [0.0, Infinity] by default) carries that clamp
        back to ``factory import hf``. docs/architecture.md says which to trust."""
        cfg: MambaConfig = self.config(model)
        return {
            "mamba_num_heads": cfg.heads,
            "mamba_head_dim": cfg.head_dim,
            "ssm_state_size": cfg.state_size,
            "n_groups": cfg.groups,
            "conv_kernel": cfg.conv_kernel,
            "chunk_size": cfg.chunk_size,
            "expand": 2,
            "mamba_hidden_act": "silu",
            "use_conv_bias": cfg.conv_bias,
            "use_bias": cfg.bias,
            "mamba_proj_bias": cfg.bias,
            "time_step_min": cfg.dt_min,
            "time_step_max": cfg.dt_max,
            "time_step_floor": cfg.dt_init_floor,
            "time_step_limit": [cfg.dt_limit_min, math.inf],
        }

    def from_hf(self, cfg: dict[str, Any]) -> dict[str, Any]:
        init_min = cfg.get("time_step_min") or 0.001
        limit = cfg.get("time_step_limit") or [0.0]
        return {
            "heads": cfg["mamba_num_heads"],
            "head_dim": cfg["mamba_head_dim"],
            "state_size": cfg.get("ssm_state_size", 128),
            "groups": cfg.get("n_groups", 8),
            "conv_kernel": cfg.get("conv_kernel", 4),
            "chunk_size": cfg.get("chunk_size", 128),
            "dt_min": init_min,
            "dt_max": cfg.get("time_step_max", 0.1),
            "dt_init_floor": cfg.get("time_step_floor", 1e-4),
            "dt_limit_min": float(limit[0] or 0.0),
            "conv_bias": cfg.get("use_conv_bias", True),
            "bias": cfg.get("use_bias", False),
        }
