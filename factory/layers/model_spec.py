"""``model_spec(model) -> ModelSpec``: every tensor of the model, main stack and MTP, by name.

The spec is the one description of the architecture. Each residual block is
``x + mixer(norm(x))`` (Megatron's hybrid model and the Hugging Face
checkpoints: ``layers.{i}.norm`` and ``layers.{i}.mixer.*``); the registered
layer type of its pattern symbol declares the mixer. Names are the built
graph's ``state_dict`` keys, and ``factory.graph`` checks every build against
them.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache

from factory.layers import mtp
from factory.schemas.model import ModelConfig
from factory.spec.layer_type import LAYER_TYPES, LayerType, layer_type, registry_revision
from factory.spec.tensors import Gemm, Init, Role, Split, TensorSpec, norm

__all__ = ["LayerSpec", "ModelSpec", "expert_layer_types", "model_spec"]


@dataclass(frozen=True)
class LayerSpec:
    """One residual block: its pre-norm, its mixer and, in MTP blocks, the block's extras."""

    prefix: str
    """``backbone.layers.{i}`` or ``mtp.layers.{j}``."""
    symbol: str
    index: int | None
    """Position in the main stack; None for MTP layers."""
    applications: int
    """Times each token runs through it per forward pass (a repeated MTP block: depth)."""
    tensors: tuple[TensorSpec, ...]

    @property
    def type(self) -> LayerType:
        return layer_type(self.symbol)

    @property
    def is_mtp(self) -> bool:
        return self.index is None


@dataclass(frozen=True)
class ModelSpec:
    model: ModelConfig
    embedding: TensorSpec
    layers: tuple[LayerSpec, ...]
    """Main-stack layers in order, then the stored MTP layers."""
    final_norm: TensorSpec
    head: TensorSpec

    @property
    def main_layers(self) -> tuple[LayerSpec, ...]:
        return tuple(layer for layer in self.layers if not layer.is_mtp)

    @property
    def mtp_layers(self) -> tuple[LayerSpec, ...]:
        return tuple(layer for layer in self.layers if layer.is_mtp)

    def tensors(self) -> Iterator[TensorSpec]:
        """Every tensor in the graph's ``state_dict`` order (a tied head included)."""
        yield self.embedding
        for layer in self.main_layers:
            yield from layer.tensors
        yield self.final_norm
        yield self.head
        for layer in self.mtp_layers:
            yield from layer.tensors

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {t.name: t.shape for t in self.tensors()}

    def gemms(self) -> Iterator[tuple[LayerSpec | None, TensorSpec]]:
        """(layer, weight) of every matrix product the precision policy may quantize."""
        for layer in self.layers:
            for tensor in layer.tensors:
                if tensor.gemm is not None and tensor.gemm.quantizable:
                    yield layer, tensor

    def layer_count(self) -> int:
        """Layers that own parameters (main and stored MTP): the depth of Megatron's
        scaled init."""
        return len(self.layers)


def _block(model: ModelConfig, prefix: str, symbol: str) -> list[TensorSpec]:
    return [
        norm(f"{prefix}.norm.weight", model.hidden_size),
        *layer_type(symbol).mixer_tensors(model, f"{prefix}.mixer"),
    ]


def _mtp_layers(model: ModelConfig) -> list[LayerSpec]:
    inner = model.mtp_pattern
    applications = model.mtp_depth // model.mtp_stored_blocks if model.mtp_depth else 0
    layers = []
    for block in range(model.mtp_stored_blocks):
        for i, symbol in enumerate(inner):
            prefix = mtp.layer_prefix(block, i, len(inner))
            tensors = _block(model, prefix, symbol)
            if i == 0:
                tensors += mtp.first_layer_tensors(model, prefix)
            if i == len(inner) - 1:
                tensors += mtp.last_layer_tensors(model, prefix)
            layers.append(LayerSpec(prefix, symbol, None, applications, tuple(tensors)))
    return layers


def model_spec(model: ModelConfig) -> ModelSpec:
    """The spec of ``model`` (cached: configs are frozen; a change of the layer-type registry
    starts afresh)."""
    return _model_spec(model, registry_revision())


@lru_cache(maxsize=64)
def _model_spec(model: ModelConfig, revision: int) -> ModelSpec:
    d, vocab = model.hidden_size, model.vocab_size
    embedding = TensorSpec(
        "backbone.embeddings.weight", (vocab, d), Role.EMBEDDING, Init("normal"), Split("vocab", 0)
    )
    head = TensorSpec(
        "lm_head.weight",
        (vocab, d),
        Role.HEAD,
        Init("normal"),
        Split("vocab", 0),
        gemm=Gemm(d, vocab, quantizable=False),
        tied_to=embedding.name if model.tie_embeddings else None,
    )
    main = [
        LayerSpec(
            f"backbone.layers.{i}",
            symbol,
            i,
            1,
            tuple(_block(model, f"backbone.layers.{i}", symbol)),
        )
        for i, symbol in enumerate(model.parsed_pattern.main)
    ]
    return ModelSpec(
        model=model,
        embedding=embedding,
        layers=(*main, *_mtp_layers(model)),
        final_norm=norm("backbone.norm_f.weight", d),
        head=head,
    )


def expert_layer_types(model: ModelConfig) -> list[LayerType]:
    """The registered layer types ``model`` builds that route tokens to experts."""
    return [kind for kind in LAYER_TYPES.values() if kind.routes_experts and kind.used_by(model)]
