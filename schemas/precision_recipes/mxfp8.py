"""``mxfp8``: OCP MXFP8, E4M3 elements with an E8M0 scale per 32 along the reduction dimension
(``docs/precision.md``, 'MXFP8')."""

from __future__ import annotations

from factory.schemas.precision_recipes.registry import MegatronPreset, PrecisionRecipe

__all__ = ["MXFP8"]

BLOCK = 32
"""Elements per scale: OCP MX's 32-element blocks."""


MXFP8 = PrecisionRecipe(
    name="mxfp8",
    title="MXFP8",
    quantizes=True,
    peak_format="mxfp8",
    saved_input_bytes=1.0 + 1 / 32,  # an E8M0 scale byte per 32 elements
    colour="#17becf",
    split_block=lambda options: BLOCK,
    quantizer="factory.precision.quantizers.MXFP8Quantizer",
    te_recipe=lambda te, options: te.MXFP8BlockScaling(fp8_format=te.Format.E4M3),
    emulated_because=lambda options: (
        "MXFP8 GEMMs need block-scaled torch._scaled_mm on Blackwell (sm100), not built yet"
    ),
    megatron=lambda options: MegatronPreset(
        "bf16_with_mxfp8_mixed",
        {"fp8": "e4m3", "fp8_recipe": "mxfp8"},
        {"fp8_quantization_recipe": "mxfp8"},
    ),
)
