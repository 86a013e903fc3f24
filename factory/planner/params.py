"""Exact parameter counts, per layer type and for the whole model, read from the model spec.

Every tensor of ``factory.layers.model_spec`` counts once (a tied head shares
the embedding's storage): norm weights, conv biases, the router's expert bias
and the SSM's A_log, D and dt_bias included. The published checkpoint sizes
(``docs/architecture.md``) pin the presets.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from factory.layers.model_spec import LayerSpec, model_spec
from factory.schemas.model import ModelConfig
from factory.spec.layer_type import LAYER_TYPES
from factory.spec.tensors import TensorSpec

__all__ = ["LayerParams", "ModelParams", "count_params", "layer_params", "tensor_params"]


@dataclass(frozen=True)
class LayerParams:
    """Parameters split by how they shard: ``dense`` over TP, ``replicated`` on every TP rank
    (norms, router, latent projections, row-parallel biases), ``expert`` over ETP x EP.
    ``active`` is what one token touches."""

    dense: int
    replicated: int
    expert: int
    active: int

    @property
    def total(self) -> int:
        return self.dense + self.replicated + self.expert

    def __add__(self, other: LayerParams) -> LayerParams:
        return LayerParams(
            self.dense + other.dense,
            self.replicated + other.replicated,
            self.expert + other.expert,
            self.active + other.active,
        )


def tensor_params(tensors: Iterable[TensorSpec]) -> LayerParams:
    """Sum ``tensors`` by shard class; tied tensors count with what they are tied to."""
    by_class = {"dense": 0, "replicated": 0, "expert": 0}
    active = 0
    for tensor in tensors:
        if tensor.tied_to is None:
            by_class[tensor.shard_class] += tensor.numel
            active += tensor.active_numel
    return LayerParams(by_class["dense"], by_class["replicated"], by_class["expert"], active)


def layer_params(layer: LayerSpec) -> LayerParams:
    """Parameters of one residual block, its pre-norm included."""
    return tensor_params(layer.tensors)


@dataclass(frozen=True)
class ModelParams:
    """Parameter counts of a whole model."""

    total: int
    """Everything instantiated, MTP blocks included."""
    total_main: int
    """Without MTP."""
    active: int
    """Main-model parameters one token touches, embedding and head included."""
    embedding: int
    head: int
    final_norm: int
    mtp: int
    """Parameters of the stored MTP blocks (one block when repeated)."""
    by_layer_type: dict[str, dict[str, int]]
    """Per type: count of layers, parameters per layer, active per layer, and the total."""


def count_params(model: ModelConfig) -> ModelParams:
    """Count every parameter of ``model``."""
    spec = model_spec(model)
    by_type: dict[str, dict[str, int]] = {}
    for layer in spec.main_layers:
        one = layer_params(layer)
        entry = by_type.setdefault(
            layer.type.name,
            {"layers": 0, "per_layer": one.total, "active_per_layer": one.active, "total": 0},
        )
        entry["layers"] += 1
        entry["total"] += one.total
    body = tensor_params(t for layer in spec.main_layers for t in layer.tensors)
    edges = tensor_params((spec.embedding, spec.head, spec.final_norm))
    mtp = tensor_params(t for layer in spec.mtp_layers for t in layer.tensors)
    order = [kind.name for kind in LAYER_TYPES.values() if kind.name in by_type]
    return ModelParams(
        total=edges.total + body.total + mtp.total,
        total_main=edges.total + body.total,
        active=edges.active + body.active,
        embedding=spec.embedding.numel,
        head=0 if spec.head.tied_to else spec.head.numel,
        final_norm=spec.final_norm.numel,
        mtp=mtp.total,
        by_layer_type={name: by_type[name] for name in order},
    )
