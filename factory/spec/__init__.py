"""The model spec: one torch-free description of every tensor of the model.

``model_spec(model_config)`` lists, for every main and MTP layer, every
parameter with its ``state_dict`` name, shape, role, dtype rule, tensor- and
expert-parallel split, initialisation and GEMM. Each layer type declares its
part once, on a registered :class:`LayerType` (``factory.layers``); the
planner, graph, precision table, proxy and exports read the spec and never
re-derive the architecture from names.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from factory.spec.layer_type import (
    LAYER_TYPES,
    LayerType,
    ProxyScale,
    layer_type,
    register_layer_type,
    unregister_layer_type,
)
from factory.spec.tensors import Gemm, Init, Role, Split, TensorSpec

if TYPE_CHECKING:
    from factory.spec.model import LayerSpec, ModelSpec, model_spec

__all__ = [
    "LAYER_TYPES",
    "Gemm",
    "Init",
    "LayerSpec",
    "LayerType",
    "ModelSpec",
    "ProxyScale",
    "Role",
    "Split",
    "TensorSpec",
    "layer_type",
    "model_spec",
    "register_layer_type",
    "unregister_layer_type",
]


def __getattr__(name: str) -> Any:
    # model_spec needs the schemas, whose pattern parser needs the layer registry above:
    # resolving it on first use keeps `factory.spec.tensors` importable from the schemas.
    if name in ("LayerSpec", "ModelSpec", "model_spec"):
        return getattr(importlib.import_module("factory.spec.model"), name)
    raise AttributeError(f"module 'factory.spec' has no attribute {name!r}")
