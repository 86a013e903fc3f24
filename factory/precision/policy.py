"""Resolve a blueprint's precision section into a per-module table, without torch.

Every quantisable linear (``factory.naming``) gets a format by three rules, in
order, each overriding the last:

1. the recipe's default (``precision.recipe``);
2. ``precision.overrides``: glob -> format, later globs winning over earlier;
3. ``precision.high_precision``: the first/last N layers and listed layers stay
   BF16 whatever 1 and 2 said (Megatron's first/last-layers-BF16 contexts wrap
   the whole layer, so they beat per-module recipes).

The table also carries each linear's forward FLOPs per token (routed experts
counted top_k times), so the share of linear compute in each format can be
reported: for Super it is the published split of nvfp4.md §3.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from fnmatch import fnmatchcase

from factory.naming import layer_index_of, linear_module_names
from factory.schemas.blueprint import Blueprint
from factory.schemas.model import ModelConfig

__all__ = ["ModulePrecision", "flops_share", "resolve_policy"]


@dataclass(frozen=True)
class ModulePrecision:
    name: str
    recipe: str
    reason: str
    """Why: 'default', 'override <glob>' or 'high_precision'."""
    flops_per_token: int
    """Forward FLOPs per token of this linear (2 * in * out * times used per token)."""


def _shape(model: ModelConfig, name: str) -> tuple[int, int, int]:
    """(in, out, uses per token) of a linear from its name."""
    d = model.hidden_size
    leaf = name.rsplit(".", 1)[-1]
    if ".experts." in name and model.moe is not None:
        width = model.moe.latent_size or d
        ff = model.moe.expert_intermediate_size
        return (ff, width, model.moe.top_k) if leaf == "down_proj" else (width, ff, model.moe.top_k)
    if ".shared_experts." in name and model.moe is not None:
        ff = model.moe.shared_expert_intermediate_size
        return (ff, d, 1) if leaf == "down_proj" else (d, ff, 1)
    if leaf in ("fc1_latent_proj", "fc2_latent_proj") and model.moe and model.moe.latent_size:
        ell = model.moe.latent_size
        return (d, ell, 1) if leaf == "fc1_latent_proj" else (ell, d, 1)
    if leaf == "eh_proj":
        return (2 * d, d, 1)
    if leaf in ("in_proj", "out_proj") and model.mamba is not None:
        m = model.mamba
        return (d, m.in_proj_dim, 1) if leaf == "in_proj" else (m.d_inner, d, 1)
    if leaf in ("q_proj", "k_proj", "v_proj", "o_proj") and model.attention is not None:
        a = model.attention
        q, kv = a.heads * a.head_dim, a.kv_heads * a.head_dim
        return {
            "q_proj": (d, q, 1),
            "k_proj": (d, kv, 1),
            "v_proj": (d, kv, 1),
            "o_proj": (q, d, 1),
        }[leaf]
    if model.mlp is not None:
        ff = model.mlp.intermediate_size
        return (ff, d, 1) if leaf == "down_proj" else (d, ff, 1)
    raise ValueError(f"cannot size linear {name!r}")


def resolve_policy(bp: Blueprint) -> list[ModulePrecision]:
    model, precision = bp.model, bp.precision
    layers = model.num_layers
    hp = precision.high_precision
    high = set(range(hp.first)) | set(range(layers - hp.last, layers)) | set(hp.layers)
    table = []
    for name in linear_module_names(model):
        recipe, reason = precision.recipe, "default"
        for glob, fmt in precision.overrides.items():
            if fnmatchcase(name, glob):
                recipe, reason = fmt, f"override {glob}"
        index = layer_index_of(name)
        if index is not None and index in high and recipe != "bf16":
            recipe, reason = "bf16", "high_precision"
        fan_in, fan_out, uses = _shape(model, name)
        table.append(ModulePrecision(name, recipe, reason, 2 * fan_in * fan_out * uses))
    return table


def flops_share(table: list[ModulePrecision]) -> dict[str, float]:
    """Fraction of linear forward FLOPs per format."""
    totals: Counter[str] = Counter()
    for row in table:
        totals[row.recipe] += row.flops_per_token
    whole = sum(totals.values()) or 1
    return {recipe: totals[recipe] / whole for recipe in sorted(totals)}
