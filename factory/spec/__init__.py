"""The vocabulary of the model spec, torch-free: tensors and layer types.

A :class:`TensorSpec` says everything about one parameter (``state_dict``
name, shape, role, dtype rule, tensor- and expert-parallel split,
initialisation, GEMM); a registered :class:`LayerType` lists the tensors of
its mixer and everything else factory needs of it. Each layer type lives in
its own folder under ``factory.layers``, which also assembles the whole
model's spec (``factory.layers.model_spec``).
"""

from __future__ import annotations

from factory.spec.layer_type import (
    LAYER_TYPES,
    LayerType,
    ProxyScale,
    layer_type,
    register_layer_type,
    unregister_layer_type,
)
from factory.spec.tensors import Gemm, Init, Role, Split, TensorSpec

__all__ = [
    "LAYER_TYPES",
    "Gemm",
    "Init",
    "LayerType",
    "ProxyScale",
    "Role",
    "Split",
    "TensorSpec",
    "layer_type",
    "register_layer_type",
    "unregister_layer_type",
]
