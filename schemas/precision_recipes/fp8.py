"""``fp8``: Transformer Engine's Float8 recipes, E4M3 (and E5M2 gradients with ``format:
hybrid``) scaled per tensor, from an amax history, or per block (``precision.fp8``;
``docs/precision.md``, 'FP8 recipes')."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from factory.schemas.precision_recipes.registry import (
    MegatronPreset,
    PrecisionRecipe,
    RecipeCheck,
    RecipeFinding,
)

if TYPE_CHECKING:
    from factory.schemas.blueprint import Blueprint
    from factory.schemas.precision import FP8Options, PrecisionConfig

__all__ = ["FP8"]

BLOCKWISE_BLOCK = 128
"""Elements per scale of blockwise scaling along a GEMM dimension: 1x128 activation and
gradient blocks, 128x128 weight blocks (DeepSeek-V3)."""

_PRESETS = {
    "tensorwise": "bf16_with_fp8_current_scaling_mixed",
    "delayed": "bf16_with_fp8_delayed_scaling_mixed",
    "blockwise": "bf16_with_fp8_subchannel_scaling_mixed",
}
"""Bridge's mixed-precision preset per scaling."""


def _split_block(options: FP8Options) -> int:
    return BLOCKWISE_BLOCK if options.scaling == "blockwise" else 1


def _te_recipe(te: Any, options: FP8Options) -> Any:
    fmt = te.Format.HYBRID if options.format == "hybrid" else te.Format.E4M3
    if options.scaling == "delayed":
        return te.DelayedScaling(
            fp8_format=fmt,
            amax_history_len=options.amax_history_len,
            amax_compute_algo=options.amax_compute,
            margin=options.margin,
        )
    if options.scaling == "blockwise":  # E4M3 everywhere, as the emulation
        return te.Float8BlockScaling(fp8_format=te.Format.E4M3)
    return te.Float8CurrentScaling(fp8_format=fmt)


def _emulated_because(options: FP8Options) -> str | None:
    """Per-tensor scales are what ``torch._scaled_mm`` takes (``factory.kernels.fp8_gemm``);
    block scales are not wired to it."""
    if options.scaling == "blockwise":
        return "blockwise scales: block-scaled FP8 GEMMs are not wired to torch._scaled_mm"
    return None


def _megatron(options: FP8Options) -> MegatronPreset:
    delayed = options.scaling == "delayed"  # per-module recipes have no amax history
    return MegatronPreset(
        _PRESETS[options.scaling],
        {"fp8": options.format, "fp8_recipe": options.scaling},
        None if delayed else {"fp8_quantization_recipe": options.scaling},
    )


def _delayed_with_bf16_ends(precision: PrecisionConfig) -> bool:
    hp = precision.high_precision
    return precision.fp8.scaling == "delayed" and bool(hp.first or hp.last)


def _megatron_refusals(precision: PrecisionConfig) -> list[tuple[str, str]]:
    if not _delayed_with_bf16_ends(precision):
        return []
    return [
        ("precision.high_precision", "Megatron refuses first/last BF16 layers with delayed scaling")
    ]


def delayed_scaling_first_last(bp: Blueprint) -> Iterator[RecipeFinding]:
    """FP8 delayed scaling cannot keep first/last layers in BF16 (Megatron raises)."""
    hp = bp.precision.high_precision
    if _delayed_with_bf16_ends(bp.precision):
        yield (
            "precision.fp8.scaling",
            f"fp8 delayed scaling is incompatible with first/last BF16 layers "
            f"(high_precision first={hp.first}, last={hp.last}); use tensorwise scaling",
        )


FP8 = PrecisionRecipe(
    name="fp8",
    title="FP8",
    quantizes=True,
    peak_format="fp8",
    saved_input_bytes=1.0,  # one byte per element; the per-tensor scale is negligible
    colour="#bcbd22",
    options="fp8",
    split_block=_split_block,
    quantizer="factory.precision.quantizers.FP8Quantizer",
    te_recipe=_te_recipe,
    megatron=_megatron,
    megatron_refusals=_megatron_refusals,
    emulated_because=_emulated_because,
    checks=(RecipeCheck("precision.delayed_scaling_first_last", delayed_scaling_first_last),),
)
