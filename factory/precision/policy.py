"""Resolve a blueprint's precision section into a per-GEMM table, without torch.

Every quantizable matrix product of the model spec gets a format by three
rules, in order, each overriding the last:

1. the recipe's default (``precision.recipe``);
2. ``precision.overrides``: glob -> format over the GEMM's graph name, later
   globs winning over earlier;
3. ``precision.high_precision``: the first/last N layers and listed layers stay
   BF16 whatever 1 and 2 said (Megatron's first/last-layers-BF16 contexts wrap
   the whole layer, so they beat per-module recipes).

Names are the graph's module paths (``backbone.layers.3.mixer.in_proj``); a
routed-expert projection is one row (``...mixer.experts.up_proj``), since all
experts of a projection share a format. The router, embedding and head are
never quantized (``docs/precision.md``). Each row carries its forward FLOPs per
token (routed experts counted top_k times), so the share of linear compute in
each format can be reported: for Super it is the published split.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from fnmatch import fnmatchcase

from factory.layers.model_spec import model_spec
from factory.schemas.blueprint import Blueprint
from factory.schemas.model import ModelConfig
from factory.schemas.parallelism import GPU_SPECS
from factory.schemas.precision_recipes import HIGH_PRECISION, recipe_named
from factory.spec.tensors import Role

__all__ = [
    "ModulePrecision",
    "excluded_gemm_names",
    "flops_share",
    "gemm_paths",
    "generalized_gemm_names",
    "index_free",
    "quantizable_gemm_names",
    "resolve_policy",
    "uses_low_precision",
]


_INDEX = re.compile(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.)")


@dataclass(frozen=True)
class ModulePrecision:
    name: str
    """The GEMM's graph name: a linear's module path, or a grouped expert parameter."""
    recipe: str
    reason: str
    """Why: 'default', 'override <glob>' or 'high_precision'."""
    flops_per_token: int
    """Forward FLOPs per token of this GEMM (2 * in * out * times used per token)."""
    layer: int | None = None
    """Main-stack layer index; None for MTP layers."""
    grouped: bool = False
    """A grouped routed-expert GEMM (a hook on the experts module, not an nn.Linear)."""


def uses_low_precision(bp: Blueprint) -> bool:
    """True when the recipe or any override quantizes some GEMM."""
    return bool(bp.precision.low_precision_recipes)


def quantizable_gemm_names(model: ModelConfig) -> list[str]:
    return [tensor.gemm_name for _, tensor in model_spec(model).gemms()]


def excluded_gemm_names(model: ModelConfig) -> list[str]:
    """Weights that look like linears but are never quantized: embedding, head and routers."""
    spec = model_spec(model)
    routers = [
        tensor.module
        for layer in spec.layers
        for tensor in layer.tensors
        if tensor.role is Role.ROUTER
    ]
    return [spec.embedding.module, spec.head.module, *routers]


def index_free(name: str) -> str:
    """``name`` with every layer index written ``*`` ('backbone.layers.*.mixer.out_proj')."""
    return _INDEX.sub("*", name)


def generalized_gemm_names(model: ModelConfig) -> list[str]:
    """Distinct index-free spellings of the GEMM names, for did-you-mean suggestions: the full
    form ('backbone.layers.*.mixer.out_proj') and the short one people write
    ('*.mixer.out_proj')."""
    out: dict[str, None] = {}
    for name in quantizable_gemm_names(model):
        full = index_free(name)
        out[full] = None
        if "*" in full:
            out["*" + full.split("*", 1)[1]] = None
    return list(out)


def resolve_policy(bp: Blueprint) -> list[ModulePrecision]:
    model, precision = bp.model, bp.precision
    high = precision.high_precision.indices(model.num_layers)
    table = []
    for layer, tensor in model_spec(model).gemms():
        name = tensor.gemm_name
        recipe, reason = precision.recipe, "default"
        for glob, fmt in precision.overrides.items():
            if fnmatchcase(name, glob):
                recipe, reason = fmt, f"override {glob}"
        index = layer.index if layer is not None else None
        if index is not None and index in high and recipe_named(recipe).quantizes:
            recipe, reason = HIGH_PRECISION, "high_precision"
        grouped = tensor.role is Role.EXPERT_LINEAR
        table.append(ModulePrecision(name, recipe, reason, tensor.forward_flops(), index, grouped))
    return table


def flops_share(table: list[ModulePrecision]) -> dict[str, float]:
    """Fraction of linear forward FLOPs per format."""
    totals: Counter[str] = Counter()
    for row in table:
        totals[row.recipe] += row.flops_per_token
    whole = sum(totals.values()) or 1
    return {recipe: totals[recipe] / whole for recipe in sorted(totals)}


def gemm_paths(bp: Blueprint) -> list[str]:
    """One line per quantizing recipe the policy uses: whether factory's PyTorch runtime runs
    its GEMMs on the tensor cores of the blueprint's GPU (``torch._scaled_mm``) or emulates
    them (dequantized operands, fp32 matmul), and why (``PrecisionRecipe.emulated_because``;
    a GPU without the recipe's ``peak_format``). The performance model's times assume the
    tensor cores either way (Transformer Engine's kernels)."""
    gpu = bp.parallelism.gpu
    lines = []
    for recipe in dict.fromkeys(row.recipe for row in resolve_policy(bp)):
        record = recipe_named(recipe)
        if not record.quantizes:
            continue
        reason = record.emulated_because(bp.precision.options_for(recipe))
        if reason is None and record.peak_format not in GPU_SPECS[gpu].dense_flops:
            reason = f"{gpu} has no {record.peak_format} tensor cores"
        if reason is None:
            lines.append(
                f"{recipe}: fprop, dgrad and wgrad on {gpu}'s {record.peak_format} tensor cores "
                "(torch._scaled_mm)"
            )
        else:
            lines.append(f"{recipe}: GEMMs emulated by factory's runtime ({reason})")
    return lines
