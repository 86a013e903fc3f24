"""The ``precision`` section: which number format each linear layer computes in.

This module types and validates the policy; ``factory.precision`` resolves it
to a per-module table and installs it on the compiled graph, with the numerics
of ``factory.kernels``. Module names in ``overrides`` are the graph's names, as
``factory plan --precision`` lists them.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field
from pydantic_core import PydanticCustomError

from factory.schemas.base import (
    MAX_HIDDEN_SIZE,
    MAX_LAYERS,
    MAX_MARGIN,
    MAX_STEPS,
    LayerIndex,
    Section,
    Seed,
)

# The registry module alone (its package imports every recipe, whose modules name this one).
from factory.schemas.precision_recipes.registry import PRECISION_RECIPES, recipe_named

__all__ = [
    "FP8Options",
    "HighPrecisionLayers",
    "MoROptions",
    "NVFP4Options",
    "PrecisionConfig",
    "Recipe",
    "SwitchToBF16",
]


def _registered(name: str) -> str:
    # Asked at validation, not fixed when this module is imported, so a recipe registered
    # later (a test's) is a name like the shipped ones; the error is a Literal's.
    if name not in PRECISION_RECIPES:
        names = [repr(registered) for registered in PRECISION_RECIPES]
        expected = " or ".join(filter(None, [", ".join(names[:-1]), names[-1]]))
        raise PydanticCustomError(
            "literal_error", "Input should be {expected}", {"expected": expected}
        )
    return name


def _recipe_enum(schema: dict[str, Any]) -> None:
    schema["enum"] = list(PRECISION_RECIPES)


Recipe = Annotated[str, AfterValidator(_registered), Field(json_schema_extra=_recipe_enum)]
"""A registered recipe (``factory.schemas.precision_recipes``). bf16: no quantisation. fp8:
E4M3/E5M2 with the scaling below. nvfp4: E2M1 with E4M3 block scales. mxfp8: E4M3 with E8M0
scales over 32 elements. mor: per-tensor FP8/BF16 choice."""


class FP8Options(Section):
    """FP8 settings (Transformer Engine's Float8 recipes)."""

    format: Literal["e4m3", "hybrid"] = "hybrid"
    """hybrid: E4M3 forward, E5M2 gradients. e4m3: E4M3 everywhere."""
    scaling: Literal["tensorwise", "delayed", "blockwise"] = "tensorwise"
    """tensorwise: current per-tensor scale. delayed: scale from an amax history.
    blockwise: 1x128 activation/gradient and 128x128 weight blocks (DeepSeek style)."""
    amax_history_len: int = Field(default=1024, ge=1, le=MAX_STEPS)
    """Length of the amax history (delayed scaling only; at most 2**40)."""
    amax_compute: Literal["max", "most_recent"] = "max"
    """How the history becomes one amax (delayed scaling only)."""
    margin: int = Field(default=0, ge=0, le=MAX_MARGIN)
    """Power-of-two headroom subtracted from the scale exponent (at most 128: FP8's whole
    exponent range is 30)."""


class NVFP4Options(Section):
    """NVFP4 settings, defaulting to the published training recipe."""

    weight_tile: Literal["16x16", "1x16"] = "16x16"
    """2D 16x16 weight blocks make fprop and dgrad use identical weights."""
    hadamard: bool = True
    """Random Hadamard transform on the inputs of the weight-gradient GEMM."""
    hadamard_size: Literal[16] = 16
    """Tile size of the Hadamard transform."""
    hadamard_seed: Seed = 0
    """Seed of the random sign vector shared by every layer (0 to 2**63 - 1)."""
    stochastic_rounding: bool = True
    """Stochastic rounding of gradients (dgrad and wgrad inputs)."""


class MoROptions(Section):
    """Mixture of Representations: pick FP8 or BF16 per tensor or block from measured error."""

    threshold: float = Field(default=0.05, gt=0, lt=1)
    """Largest relative quantisation error (||q(x) - x|| / ||x||) that still uses FP8."""
    granularity: Literal["tensor", "block"] = "tensor"
    """Decide once per tensor, or once per block."""
    block_size: int = Field(default=128, ge=1, le=MAX_HIDDEN_SIZE)
    """Block edge for granularity: block (at most 2**17)."""


class HighPrecisionLayers(Section):
    """Layers kept in BF16 whatever the recipe."""

    first: int = Field(default=0, ge=0, le=MAX_LAYERS)
    """The first N layers of the main stack (at most 2**14)."""
    last: int = Field(default=0, ge=0, le=MAX_LAYERS)
    """The last N layers of the main stack (at most 2**14)."""
    layers: list[LayerIndex] = Field(default_factory=list)
    """Further 0-based layer indices (below 2**14)."""

    def indices(self, num_layers: int) -> frozenset[int]:
        """The main-stack indices kept in BF16 in a stack of ``num_layers``."""
        first = range(min(self.first, num_layers))
        last = range(max(0, num_layers - self.last), num_layers)
        return frozenset({*first, *last, *(i for i in self.layers if i < num_layers)})


class SwitchToBF16(Section):
    """Leave low precision late in training (NVFP4 paper, App. D)."""

    after_fraction: float = Field(gt=0, le=1)
    """Fraction of the training tokens after which the switch happens."""
    scope: Literal["all", "forward"] = "all"
    """Switch every GEMM, or only the forward pass (recovers most of the gap at ~6% cost)."""


class PrecisionConfig(Section):
    """The precision policy."""

    @property
    def low_precision_recipes(self) -> list[str]:
        """The quantizing recipes the policy uses, the default's and the overrides', sorted
        (empty: every GEMM stays in BF16)."""
        used = {self.recipe, *self.overrides.values()}
        return sorted(name for name in used if recipe_named(name).quantizes)

    def options_for(self, recipe: str) -> Section | None:
        """The section of ``recipe``'s settings (``fp8`` for fp8 ...); None for a recipe
        without one."""
        name = recipe_named(recipe).options
        return None if name is None else getattr(self, name)

    recipe: Recipe = "bf16"
    """Default format of every linear layer."""
    fp8: FP8Options = FP8Options()
    """Used by the fp8 recipe and by fp8 overrides."""
    nvfp4: NVFP4Options = NVFP4Options()
    """Used by the nvfp4 recipe and by nvfp4 overrides."""
    mor: MoROptions = MoROptions()
    """Used by the mor recipe and by mor overrides."""
    high_precision: HighPrecisionLayers = HighPrecisionLayers()
    """Layers kept in BF16."""
    overrides: dict[str, Recipe] = Field(default_factory=dict)
    """Module-name glob -> format, e.g. '*.mixer.out_proj: mxfp8'. When several globs match,
    the last one written wins."""
    switch_to_bf16: SwitchToBF16 | None = None
    """Switch to BF16 late in training; null keeps the recipe to the end."""
