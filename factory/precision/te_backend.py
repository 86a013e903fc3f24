"""The fast path: the same precision table on Transformer Engine (CUDA, optional).

``pip install factory[gpu]`` brings ``transformer_engine``; it is imported only
here, and only when used. :func:`apply_te` swaps every quantized linear of the
table for a ``te.Linear`` holding the same weights, run under the TE recipe of
its format: the recipe's ``te_recipe`` (``factory/schemas/precision_recipes/``) maps its
``precision.*`` settings onto the fields of TE's recipe (``docs/precision.md``, 'Transformer
Engine mapping'). A recipe without one (``mor``) stays on the emulated path.

Grouped expert GEMMs keep the emulated quantized path (correct on CUDA, not
fast); mapping them to ``te.GroupedLinear`` needs its per-expert split sizes
from the dispatcher and is left for the GPU-kernel work.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from factory.precision.apply import PrecisionRuntime, apply_precision
from factory.precision.backends import available
from factory.precision.qlinear import QuantizedLinear, quantized_matmul
from factory.schemas.blueprint import Blueprint
from factory.schemas.precision import PrecisionConfig
from factory.schemas.precision_recipes import recipe_named

__all__ = ["TELinear", "apply_te", "te_recipe", "usable"]


def usable(device: torch.device) -> bool:
    """TE is installed and the model lives on a CUDA device."""
    return device.type == "cuda" and torch.cuda.is_available() and available()


def te_recipe(recipe: str, precision: PrecisionConfig) -> Any | None:
    """The TE recipe object for one of our formats, or None where TE has none (mor)."""
    build = recipe_named(recipe).te_recipe
    if build is None:
        return None
    te = importlib.import_module("transformer_engine.common.recipe")
    return build(te, precision.options_for(recipe))


def _autocast(te: Any, recipe: Any) -> Callable[[], contextlib.AbstractContextManager[Any]]:
    """TE's quantization context: ``te.autocast`` (TE >= 2.8) or ``te.fp8_autocast``."""
    if hasattr(te, "autocast"):
        return lambda: te.autocast(enabled=True, recipe=recipe)
    return lambda: te.fp8_autocast(enabled=True, fp8_recipe=recipe)


class TELinear(nn.Module):
    """Our linear's parameters computed by a ``te.Linear`` under one TE recipe.

    The parameters stay ours (shared with the TE module, which is deliberately
    not a registered child), so the state dict keeps the checkpoint's keys and
    the optimizer sees the same tensors.
    """

    def __init__(self, linear: QuantizedLinear, te: Any, recipe: Any) -> None:
        super().__init__()
        self.quantizer = linear.quantizer
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        inner = te.Linear(
            linear.in_features,
            linear.out_features,
            bias=linear.bias is not None,
            params_dtype=linear.weight.dtype,
            device=linear.weight.device,
        )
        inner.weight = self.weight
        if self.bias is not None:
            inner.bias = self.bias
        self._te = (inner,)
        self._context = _autocast(te, recipe)
        self.quantize_forward = self.quantize_backward = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quantize_forward:
            with self._context():
                return self._te[0](x)
        if not self.quantize_backward:
            return torch.nn.functional.linear(x, self.weight, self.bias)
        # A forward-only switch to BF16: TE quantizes the backward only inside the forward's
        # autocast, so this case runs the emulated GEMMs with the same recipe.
        y = quantized_matmul(x, self.weight, self.quantizer, fwd=False, bwd=True)
        return y + self.bias if self.bias is not None else y


def apply_te(model: nn.Module, blueprint: Blueprint, seed: int = 0) -> PrecisionRuntime:
    """Install the precision table with TE linears where TE has the format.

    The emulated quantizers are installed first (experts, MoR); each quantized
    ``nn.Linear`` with a TE recipe is then replaced by a :class:`TELinear`.
    """
    te = importlib.import_module("transformer_engine.pytorch")
    runtime = apply_precision(model, blueprint, seed=seed)
    recipes: dict[str, Any] = {}
    ops: list[Any] = []
    for op in runtime.ops:
        if not isinstance(op, QuantizedLinear):
            ops.append(op)
    for row in runtime.table:
        if not recipe_named(row.recipe).quantizes or row.grouped:
            continue
        if row.recipe not in recipes:
            recipes[row.recipe] = te_recipe(row.recipe, blueprint.precision)
        recipe = recipes[row.recipe]
        path = row.name
        linear = model.get_submodule(path)
        assert isinstance(linear, QuantizedLinear), path
        if recipe is None:
            ops.append(linear)
            continue
        replacement = TELinear(linear, te, recipe)
        parent, _, attr = path.rpartition(".")
        setattr(model.get_submodule(parent), attr, replacement)
        ops.append(replacement)
    runtime.ops = ops
    return runtime
