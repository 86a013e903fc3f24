"""``nvfp4``: E2M1 elements with an E4M3 scale per 16 and an fp32 scale per tensor, the NVFP4
paper's training recipe (``precision.nvfp4``; ``docs/precision.md``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from factory.schemas.precision_recipes.registry import MegatronPreset, PrecisionRecipe

if TYPE_CHECKING:
    from factory.schemas.precision import NVFP4Options, PrecisionConfig

__all__ = ["NVFP4"]

BLOCK = 16
"""Elements per scale along a GEMM dimension: the 1x16 blocks, the 16x16 weight tiles and the
16-token Hadamard tiles (``docs/precision.md``, 'Formats')."""


def _te_recipe(te: Any, options: NVFP4Options) -> Any:
    return te.NVFP4BlockScaling(
        disable_rht=not options.hadamard,
        disable_stochastic_rounding=not options.stochastic_rounding,
        disable_2d_quantization=options.weight_tile != "16x16",
    )


def _megatron(options: NVFP4Options) -> MegatronPreset:
    return MegatronPreset(
        "bf16_with_nvfp4_mixed",
        {"fp4": "e2m1", "fp4_recipe": "nvfp4"},
        {"fp4_quantization_recipe": "nvfp4"},
    )


def _megatron_refusals(precision: PrecisionConfig) -> list[tuple[str, str]]:
    if precision.nvfp4 == type(precision.nvfp4)():
        return []
    return [
        (
            "precision.nvfp4",
            "Transformer Engine's NVFP4BlockScaling recipe is fixed "
            "(16x16 weight tiles, Hadamard wgrad, stochastic rounding)",
        )
    ]


NVFP4 = PrecisionRecipe(
    name="nvfp4",
    title="NVFP4",
    quantizes=True,
    peak_format="nvfp4",
    saved_input_bytes=0.5 + 1 / 16,  # an E4M3 scale byte per 16 elements
    colour="#e7298a",
    options="nvfp4",
    split_block=lambda options: BLOCK,
    quantizer="factory.precision.quantizers.NVFP4Quantizer",
    te_recipe=_te_recipe,
    megatron=_megatron,
    megatron_refusals=_megatron_refusals,
    emulated_because=lambda options: (
        "NVFP4 GEMMs need block-scaled torch._scaled_mm on Blackwell (sm100), not built yet"
    ),
)
