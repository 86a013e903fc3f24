"""``mor``: Mixture of Representations, FP8 (E4M3) or BF16 chosen per tensor or block from the
measured error (``precision.mor``; ``docs/precision.md``, 'MoR')."""

from __future__ import annotations

from typing import TYPE_CHECKING

from factory.schemas.precision_recipes.registry import PrecisionRecipe

if TYPE_CHECKING:
    from factory.schemas.precision import MoROptions

__all__ = ["MOR"]


def _split_block(options: MoROptions) -> int:
    return options.block_size if options.granularity == "block" else 1


MOR = PrecisionRecipe(
    name="mor",
    title="Mixture of Representations",
    quantizes=True,
    peak_format="fp8",  # the FP8 choice runs on FP8 tensor cores
    saved_input_bytes=2,  # it picks per tensor: counted as the BF16 input
    colour="#8c564b",
    options="mor",
    split_block=_split_block,
    quantizer="factory.precision.quantizers.MoRQuantizer",
    emulated_because=lambda options: (
        "MoR picks FP8 or BF16 per tensor or block at run time; no GEMM is wired for the mix"
    ),
    # No Transformer Engine recipe: MoR always runs emulated. No Megatron recipe either.
)
