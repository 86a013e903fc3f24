"""What the performance model needs of a model, computed once per (model, sequence length).

``factory.planner.performance`` predicts a step for many layouts of one model (the
layout search asks for thousands); everything here depends on the model and the
sequence length only, so it is read from the layer registry and the model's tensors
once and cached as plain numbers: per distinct block, its GEMMs (widths, how tensor
and expert parallelism split them, whether the precision policy may quantize them),
its core work, elementwise traffic, expert dispatch and parameters by how they shard.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from factory.layers.model_spec import LayerSpec, model_spec
from factory.planner.flops import flops_per_token
from factory.schemas.model import ModelConfig
from factory.spec.layer_type import registry_revision
from factory.spec.tensors import TensorSpec

__all__ = ["BlockTerms", "GemmTerm", "ModelTerms", "model_terms"]


@dataclass(frozen=True)
class GemmTerm:
    """One weight's matrix product, per token of the pass that runs it."""

    in_features: int
    out_features: int
    uses: int
    """Products per token (top_k for routed experts)."""
    split: str
    """How tensor parallelism splits it: 'column' (output), 'row' (input) or 'none'."""
    expert: bool
    """A routed expert's weight: expert parallelism spreads its experts, ETP splits each."""
    experts: int
    """Routed experts of the layer (0 for a dense weight)."""
    quantizable: bool


@dataclass(frozen=True)
class BlockTerms:
    """One residual block (every block of a layer type is alike; MTP blocks add their
    extras), per token of one forward pass."""

    name: str
    """The layer type's name ('mamba', 'attention', ...)."""
    symbol: str
    gemms: tuple[GemmTerm, ...]
    core_flops: int
    core_bytes: float
    core_coefficient: str
    core_exponentials: float
    """Softmax exponentials per token of one forward pass (``LayerType.core_exponentials``)."""
    elementwise_values: int
    dispatch_values: int
    """Values per token in each expert-parallel all-to-all (0: the block routes no experts)."""
    selective_core_flops: int
    selective_elementwise_values: int
    tp_params: int
    """Parameters tensor parallelism splits."""
    replicated_params: int
    """Parameters every tensor-parallel rank holds whole (norms, the router, latent projections)."""
    expert_params: int
    """Routed-expert parameters (split over EP x ETP)."""


@dataclass(frozen=True)
class ModelTerms:
    seq_len: int
    hidden_size: int
    vocab_size: int
    main: tuple[BlockTerms, ...]
    """Main-stack blocks in order."""
    mtp: tuple[tuple[BlockTerms, int], ...]
    """MTP blocks with the times each token runs through them; they run on the last rank."""
    mtp_heads: int
    """Extra output-head products per token: one per MTP depth."""
    flops_per_token: int
    """Training FLOPs per token, the plan's exact count (for MFU)."""


def _gemm(tensor: TensorSpec) -> GemmTerm | None:
    if tensor.gemm is None:
        return None
    g = tensor.gemm
    split = "none" if tensor.tp is None else ("row" if tensor.tp.kind == "row" else "column")
    experts = tensor.shape[tensor.expert_dim] if tensor.expert_dim is not None else 0
    return GemmTerm(
        g.in_features,
        g.out_features,
        g.uses,
        split,
        tensor.expert_dim is not None,
        experts,
        g.quantizable,
    )


def _block(layer: LayerSpec, model: ModelConfig, seq_len: int) -> BlockTerms:
    kind = layer.type
    core_flops, core_bytes = kind.core_work(model, seq_len)
    again_flops, again_values = kind.selective_recompute(model, seq_len)
    by_class = {"dense": 0, "replicated": 0, "expert": 0}
    for tensor in layer.tensors:
        if tensor.trainable:
            by_class[tensor.shard_class] += tensor.numel
    return BlockTerms(
        name=kind.name,
        symbol=layer.symbol,
        gemms=tuple(g for t in layer.tensors if (g := _gemm(t)) is not None),
        core_flops=core_flops,
        core_bytes=core_bytes,
        core_coefficient=kind.core_coefficient,
        core_exponentials=kind.core_exponentials(model, seq_len),
        elementwise_values=kind.elementwise_values(model),
        dispatch_values=kind.dispatch_values(model) if kind.routes_experts else 0,
        selective_core_flops=again_flops,
        selective_elementwise_values=again_values,
        tp_params=by_class["dense"],
        replicated_params=by_class["replicated"],
        expert_params=by_class["expert"],
    )


def model_terms(model: ModelConfig, seq_len: int) -> ModelTerms:
    """The cached terms of ``model`` at ``seq_len`` (a change of the registry starts afresh)."""
    return _model_terms(model, seq_len, registry_revision())


@lru_cache(maxsize=64)
def _model_terms(model: ModelConfig, seq_len: int, revision: int) -> ModelTerms:
    spec = model_spec(model)
    alike: dict[tuple[str, tuple[str, ...]], BlockTerms] = {}

    def block(layer: LayerSpec) -> BlockTerms:
        # Blocks of one type differ only by name: key them by their tensors' local names.
        key = (layer.symbol, tuple(t.name.removeprefix(layer.prefix) for t in layer.tensors))
        if key not in alike:
            alike[key] = _block(layer, model, seq_len)
        return alike[key]

    return ModelTerms(
        seq_len=seq_len,
        hidden_size=model.hidden_size,
        vocab_size=model.vocab_size,
        main=tuple(block(layer) for layer in spec.main_layers),
        mtp=tuple((block(layer), layer.applications) for layer in spec.mtp_layers),
        mtp_heads=model.mtp_depth,
        flops_per_token=flops_per_token(model, seq_len).exact,
    )
