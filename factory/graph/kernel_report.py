"""The kernels a model runs on a device, by layer type: what a run prints in its first lines.

Each registered layer type used by the model answers for its own operations
(``LayerType.kernel_choices``, from its ``module.py``); nothing here knows which
layer types exist.
"""

from __future__ import annotations

from collections.abc import Iterable

import factory.layers  # noqa: F401  (registers the built-in layer types)
from factory.kernels.choice import KernelChoice
from factory.schemas.model import ModelConfig
from factory.spec.layer_type import LAYER_TYPES

__all__ = ["kernel_choices", "kernel_lines"]


def kernel_choices(model: ModelConfig, device: str) -> list[tuple[str, KernelChoice]]:
    """(layer type name, choice) for every operation of every layer type ``model`` builds,
    in registration order, for tensors on ``device`` (``"cuda"``, ``"cpu"``)."""
    return [
        (layer.name, choice)
        for layer in LAYER_TYPES.values()
        if layer.used_by(model)
        for choice in layer.kernel_choices(model, device)
    ]


def kernel_lines(
    model: ModelConfig, device: str, extra: Iterable[tuple[str, KernelChoice]] = ()
) -> list[str]:
    """One line per operation, ``kernels: <layer> <op>: <kernel> (fallback: <why>)``, then
    one per ``extra`` entry (a run adds what only its built model knows:
    ``factory.runtime.run_kernels``)."""
    entries = [*kernel_choices(model, device), *extra]
    return [f"kernels: {name} {c.describe()}" for name, c in entries]
