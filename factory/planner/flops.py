"""Training FLOPs per token, two ways: Megatron-LM's formula and our exact count.

``megatron`` reproduces ``num_floating_point_operations`` (hybrid branch) of
Megatron-LM term for term (``docs/flops.md``),
so MFU figures compare one to one with what a Megatron run logs, its known
inaccuracies included: Mamba uses d_in = 2h whatever the real d_inner, the
conv1d and router are not counted, and MTP layers count like main layers.

``exact`` counts every matrix product the model really runs: the real Mamba
d_inner and in_proj width, the conv1d, the SSD chunked scan as executed, the
router, latent projections, shared and routed experts, the causal attention
core over its exact average context, and the MTP blocks. Elementwise work
(norms, activations, softmax, gating, residual adds, SSD decay masks and state
passing) is not counted: it is memory bound and a rounding error next to the
GEMMs. The one exception is a bias add, which belongs to a linear layer's
affine map and costs one FLOP per output.

Training is 3x forward (backward = 2x forward: data and weight gradients).
These are model FLOPs: activation recomputation is not included. Everything is
an exact integer; a GEMM of [m, k] x [k, n] costs 2mnk.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from factory.layers.model_spec import LayerSpec, model_spec
from factory.schemas.model import ModelConfig
from factory.spec.layer_type import LAYER_TYPES, layer_type

__all__ = ["FlopsPerToken", "flops_keys", "flops_per_token", "megatron_flops_per_sequence"]

_TRAIN = 3  # forward + backward (data grads + weight grads)


def flops_keys() -> tuple[str, ...]:
    """Keys of ``FlopsPerToken.by_layer_type``: every registered layer type, 'head', 'mtp'."""
    return (*(kind.name for kind in LAYER_TYPES.values()), "head", "mtp")


@dataclass(frozen=True)
class FlopsPerToken:
    """Training FLOPs (forward + backward) per token at one sequence length."""

    seq_len: int
    megatron: int | None
    """Megatron-LM's hybrid formula, per token; None when a layer type of the pattern has no
    Megatron formula (``LayerType.megatron_flops``)."""
    exact: int
    """Our exact count, per token (= 3 x exact_forward)."""
    exact_forward: int
    """Our exact count of the forward pass, per token."""
    by_layer_type: dict[str, int] = field(default_factory=dict)
    """``exact`` split by :func:`flops_keys`: the main stack's layer types, 'head' and 'mtp'
    (eh_proj, inner layers and head of every depth); the values sum to ``exact``."""
    megatron_by_layer_type: dict[str, int] = field(default_factory=dict)
    """``megatron`` split as Megatron sees it: MTP inner layers are counted under their own
    layer type, and 'head' holds the logits of the main head and every MTP depth."""

    def to_dict(self) -> dict[str, object]:
        return {
            "seq_len": self.seq_len,
            "megatron": self.megatron,
            "exact": self.exact,
            "exact_forward": self.exact_forward,
            "by_layer_type": dict(self.by_layer_type),
            "megatron_by_layer_type": dict(self.megatron_by_layer_type),
        }


# --------------------------------------------------------------------------- Megatron's formula


def _megatron_split(model: ModelConfig, seq_len: int) -> dict[str, int] | None:
    """Training FLOPs of one sequence by Megatron's formula, per layer type plus 'head'; None
    when a layer type of the pattern has no Megatron formula.

    Layer counts are get_hybrid_layer_counts': the MTP pattern's layers count once per depth.
    """
    counts = dict.fromkeys(model.parsed_pattern.main + model.mtp_pattern, 0)
    for symbol in model.parsed_pattern.main:
        counts[symbol] += 1
    for symbol in model.mtp_pattern:
        counts[symbol] += model.mtp_depth
    split = {}
    for symbol, count in sorted(counts.items(), key=lambda kv: list(LAYER_TYPES).index(kv[0])):
        one_layer = layer_type(symbol).megatron_flops(model, seq_len)
        if one_layer is None:
            return None
        split[layer_type(symbol).name] = _TRAIN * count * one_layer
    h, vocab = model.hidden_size, model.vocab_size
    split["head"] = _TRAIN * 2 * seq_len * h * vocab * (1 + model.mtp_depth)
    return split


def megatron_flops_per_sequence(model: ModelConfig, seq_len: int) -> int | None:
    """Megatron-LM's training FLOPs for one sequence of ``seq_len`` tokens (T = s, S2 = s^2);
    None when a layer type of the pattern has no Megatron formula."""
    split = _megatron_split(model, seq_len)
    return None if split is None else sum(split.values())


# --------------------------------------------------------------------------- exact forward count


def layer_forward_flops(layer: LayerSpec, model: ModelConfig, seq_len: int) -> int:
    """Forward FLOPs per token of one pass through ``layer``: its tensors' products plus what
    its layer type declares beyond them."""
    tensors = sum(tensor.forward_flops() for tensor in layer.tensors)
    return tensors + layer.type.extra_flops(model, seq_len)


def _exact_forward_split(model: ModelConfig, seq_len: int) -> dict[str, int]:
    """Forward FLOPs per token, keyed by :func:`flops_keys`."""
    spec = model_spec(model)
    split = dict.fromkeys(flops_keys(), 0)
    for layer in spec.main_layers:
        split[layer.type.name] += layer_forward_flops(layer, model, seq_len)
    head = spec.head.forward_flops()  # the embedding lookup is a gather, not a FLOP
    split["head"] = head
    for layer in spec.mtp_layers:
        split["mtp"] += layer.applications * layer_forward_flops(layer, model, seq_len)
    split["mtp"] += model.mtp_depth * head
    return split


def flops_per_token(model: ModelConfig, seq_len: int) -> FlopsPerToken:
    """Training FLOPs per token of ``model`` on sequences of ``seq_len`` tokens."""
    if seq_len < 1:
        raise ValueError(f"seq_len must be positive, got {seq_len}")
    forward = _exact_forward_split(model, seq_len)
    megatron = _megatron_split(model, seq_len)
    # Every Megatron term is T * x + S2 * y with T = s and S2 = s^2, so the divisions are exact.
    megatron_per_token = {k: v // seq_len for k, v in (megatron or {}).items()}
    return FlopsPerToken(
        seq_len=seq_len,
        megatron=sum(megatron_per_token.values()) if megatron is not None else None,
        exact=_TRAIN * sum(forward.values()),
        exact_forward=sum(forward.values()),
        by_layer_type={k: _TRAIN * v for k, v in forward.items()},
        megatron_by_layer_type=megatron_per_token,
    )
