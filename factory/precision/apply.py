"""Apply a resolved precision table to a compiled graph, and switch it to BF16 late.

:func:`apply_precision` walks :func:`~factory.precision.policy.resolve_policy`'s
table: every linear whose recipe quantizes becomes a
:class:`~factory.precision.qlinear.QuantizedLinear` sharing its parameters, and
every grouped expert layer gets a
:class:`~factory.precision.qlinear.QuantizedExpertLinear` hook with one
quantizer per projection. BF16 rows stay plain modules: on CPU they compute in
the model's dtype. Embeddings, the output head, norms, routers and attention
internals are never in the table (``docs/precision.md``, 'GEMM operands'), so they
stay as they are.

The returned :class:`PrecisionRuntime` is the training loop's handle: it
reports what runs in which format and performs ``switch_to_bf16`` once the
configured fraction of the training tokens has been seen.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from factory.kernels.choice import KernelChoice
from factory.precision.policy import ModulePrecision, resolve_policy
from factory.precision.qlinear import QuantizedExpertLinear, QuantizedLinear
from factory.precision.quantizers import GemmQuantizer, MoRQuantizer, make_quantizer
from factory.schemas.blueprint import Blueprint
from factory.schemas.precision import SwitchToBF16
from factory.schemas.precision_recipes import recipe_named

__all__ = ["PrecisionRuntime", "apply_precision", "kernel_choices"]


@dataclass
class PrecisionRuntime:
    """What :func:`apply_precision` installed, and the late switch to BF16."""

    table: list[ModulePrecision]
    quantizers: dict[str, GemmQuantizer]
    """Policy-table name -> its quantizer, for every quantized linear."""
    ops: list[QuantizedLinear | QuantizedExpertLinear] = field(default_factory=list)
    switch: SwitchToBF16 | None = None
    total_tokens: int = 0
    switched: bool = False

    def recipes(self) -> Counter[str]:
        """Number of linears per format, as installed."""
        return Counter(row.recipe for row in self.table)

    def mor_fp8_fraction(self) -> float | None:
        """Fraction of MoR tensors/blocks kept in FP8 so far (None without MoR modules)."""
        stats = [q.stats for q in self.quantizers.values() if isinstance(q, MoRQuantizer)]
        total = sum(s.total_units for s in stats)
        if not stats:
            return None
        return sum(s.fp8_units for s in stats) / total if total else 1.0

    def kernel_choices(self, device: str) -> list[KernelChoice]:
        """What runs the quantized GEMMs of each recipe installed, on ``device``: one choice
        per recipe (its first module's quantizer answers for all of its modules)."""
        first: dict[str, GemmQuantizer] = {}
        for quantizer in self.quantizers.values():
            first.setdefault(quantizer.recipe, quantizer)
        return [quantizer.gemm_kernel(device) for quantizer in first.values()]

    def set_quantization(self, forward: bool, backward: bool) -> None:
        """Turn quantization of the forward / backward GEMMs on or off everywhere."""
        for op in self.ops:
            op.quantize_forward, op.quantize_backward = forward, backward

    def state_dict(self) -> dict[str, Any]:
        """The late switch and every quantizer's state, for checkpoints."""
        return {
            "switched": self.switched,
            "quantizers": {name: q.state_dict() for name, q in self.quantizers.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name, quantizer in self.quantizers.items():
            quantizer.load_state_dict(state["quantizers"][name])
        if state["switched"] and not self.switched:
            self.set_quantization(
                forward=False, backward=self.switch is not None and self.switch.scope == "forward"
            )
            self.switched = True

    def weights_updated(self) -> None:
        """Forget every cached weight cast: call after each optimizer step and checkpoint load.

        The cache notices an in-place update of the tensor it cast (its version moves),
        but FSDP2 gathers each step's weights into the same unsharded tensor without
        moving its version, so the runtime says it instead."""
        for quantizer in self.quantizers.values():
            quantizer.forget_weight_cast()

    def on_tokens(self, tokens_seen: int) -> bool:
        """Call after each step; switches to BF16 once ``after_fraction`` of the training
        tokens are seen (scope ``forward``: only the forward GEMMs). True on the switch."""
        if self.switch is None or self.switched or not self.total_tokens:
            return False
        if tokens_seen < self.switch.after_fraction * self.total_tokens:
            return False
        self.set_quantization(forward=False, backward=self.switch.scope == "forward")
        self.switched = True
        return True


def apply_precision(model: nn.Module, blueprint: Blueprint, seed: int = 0) -> PrecisionRuntime:
    """Quantize ``model``'s linears in place per ``blueprint``'s precision policy.

    ``model`` must be the graph of ``blueprint.model`` (``factory.compile`` builds
    it). ``seed`` seeds each module's stochastic rounding (seed + table row),
    so runs are reproducible.
    """
    precision = blueprint.precision
    table = resolve_policy(blueprint)
    runtime = PrecisionRuntime(
        table=table,
        quantizers={},
        switch=precision.switch_to_bf16,
        total_tokens=blueprint.training_tokens,
    )
    expert_hooks: dict[str, dict[str, GemmQuantizer]] = {}
    for row_index, row in enumerate(table):
        if not recipe_named(row.recipe).quantizes:
            continue
        options = precision.options_for(row.recipe)
        quantizer = make_quantizer(row.recipe, options, seed=seed + row_index)
        runtime.quantizers[row.name] = quantizer
        if row.grouped:
            owner, projection = row.name.rsplit(".", 1)
            expert_hooks.setdefault(owner, {})[projection] = quantizer
            continue
        path = row.name
        linear = model.get_submodule(path)
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"{path} is {type(linear).__name__}, expected nn.Linear")
        quantized = QuantizedLinear.from_linear(linear, quantizer)
        parent, _, attr = path.rpartition(".")
        setattr(model.get_submodule(parent), attr, quantized)
        runtime.ops.append(quantized)
    for path, quantizers in expert_hooks.items():
        hook = QuantizedExpertLinear(quantizers)
        model.get_submodule(path).linear = hook
        runtime.ops.append(hook)
    return runtime


def kernel_choices(blueprint: Blueprint, device: str) -> list[KernelChoice]:
    """What runs the quantized GEMMs of each recipe ``blueprint``'s precision policy uses, on
    ``device``, before any model is built: one choice per recipe, in policy-table order."""
    precision = blueprint.precision
    recipes = dict.fromkeys(
        row.recipe for row in resolve_policy(blueprint) if recipe_named(row.recipe).quantizes
    )
    return [
        make_quantizer(recipe, precision.options_for(recipe)).gemm_kernel(device)
        for recipe in recipes
    ]
