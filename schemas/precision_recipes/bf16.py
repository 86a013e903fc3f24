"""``bf16``: every GEMM unquantized, the format ``precision.high_precision`` layers keep."""

from __future__ import annotations

from factory.schemas.precision_recipes.registry import MegatronPreset, PrecisionRecipe

__all__ = ["BF16"]

BF16 = PrecisionRecipe(
    name="bf16",
    title="BF16",
    quantizes=False,
    peak_format="bf16",
    saved_input_bytes=2,  # the BF16 input itself
    colour="#b8b8b8",
    # No FP8/FP4 recipe: a module in bf16 runs in high precision under any preset.
    megatron=lambda options: MegatronPreset("bf16_mixed", module_recipe={}),
)
