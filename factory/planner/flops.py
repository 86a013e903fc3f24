"""Training FLOPs per token, two ways: Megatron-LM's formula and our exact count.

``megatron`` reproduces ``num_floating_point_operations`` (hybrid branch) of
Megatron-LM term for term (``architecture.md`` §5.4, ``parallelism.md`` §2.2),
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

from factory.schemas.model import AttentionConfig, MambaConfig, MLPConfig, ModelConfig, MoEConfig
from factory.schemas.pattern import LAYER_SYMBOLS

__all__ = ["FLOPS_KEYS", "FlopsPerToken", "flops_per_token", "megatron_flops_per_sequence"]

FLOPS_KEYS: tuple[str, ...] = ("mamba", "attention", "mlp", "moe", "head", "mtp")
"""Keys of ``FlopsPerToken.by_layer_type``."""

_TRAIN = 3  # forward + backward (data grads + weight grads)


@dataclass(frozen=True)
class FlopsPerToken:
    """Training FLOPs (forward + backward) per token at one sequence length."""

    seq_len: int
    megatron: int
    """Megatron-LM's hybrid formula, per token."""
    exact: int
    """Our exact count, per token (= 3 x exact_forward)."""
    exact_forward: int
    """Our exact count of the forward pass, per token."""
    by_layer_type: dict[str, int] = field(default_factory=dict)
    """``exact`` split into 'mamba', 'attention', 'mlp', 'moe' (main stack), 'head' and 'mtp'
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


def _swiglu(activation: str) -> bool:
    return activation == "swiglu"


# --------------------------------------------------------------------------- Megatron's formula
# Each helper returns the forward FLOPs of one layer over one sequence (T = s tokens, S2 = s^2),
# written as in training.py::hybrid_flops with h*p = heads*kv_channels kept integral.


def _megatron_attention(h: int, cfg: AttentionConfig, s: int) -> int:
    q = cfg.heads * cfg.head_dim  # h * p
    kv = cfg.kv_heads * cfg.head_dim  # h * p * g / n
    return 4 * s * h * (q + kv) + 2 * s * s * q


def _megatron_mamba(h: int, cfg: MambaConfig, s: int) -> int:
    d_in = 2 * h  # hard-coded in Megatron, whatever heads * head_dim is
    n = cfg.state_size
    in_proj = 2 * s * h * (2 * d_in + 2 * cfg.groups * n + cfg.heads)
    scan = 7 * s * d_in * n
    out_proj = 2 * s * d_in * h
    return in_proj + scan + out_proj


def _megatron_mlp(h: int, cfg: MLPConfig, s: int) -> int:
    # 4 * (ffn / h) * (1.5 if swiglu) * T * h^2, kept integral
    base = 4 * s * h * cfg.intermediate_size
    return base * 3 // 2 if _swiglu(cfg.activation) else base


def _megatron_moe(h: int, cfg: MoEConfig, s: int) -> int:
    # Megatron has one global swiglu flag; here the MoE section's own activation sets it.
    def sw(x: int) -> int:
        return x * 3 // 2 if _swiglu(cfg.activation) else x

    ff, k = cfg.expert_intermediate_size, cfg.top_k
    if cfg.latent_size:
        routed = sw(4 * s * cfg.latent_size * ff * k) + 4 * s * h * cfg.latent_size
    else:
        routed = sw(4 * s * h * ff * k)
    return routed + sw(4 * s * h * cfg.shared_expert_intermediate_size)


def _megatron_layer(model: ModelConfig, layer_type: str, s: int) -> int:
    h = model.hidden_size
    if layer_type == "attention" and model.attention is not None:
        return _megatron_attention(h, model.attention, s)
    if layer_type == "mamba" and model.mamba is not None:
        return _megatron_mamba(h, model.mamba, s)
    if layer_type == "mlp" and model.mlp is not None:
        return _megatron_mlp(h, model.mlp, s)
    if layer_type == "moe" and model.moe is not None:
        return _megatron_moe(h, model.moe, s)
    raise ValueError(f"model has no {layer_type!r} section for its pattern")


def _megatron_counts(model: ModelConfig) -> dict[str, int]:
    """Layer counts as get_hybrid_layer_counts returns them: MTP pattern layers x depth."""
    counts = model.layout.counts()
    for symbol in model.mtp_pattern:
        counts[LAYER_SYMBOLS[symbol]] += model.mtp_depth
    return counts


def _megatron_split(model: ModelConfig, seq_len: int) -> dict[str, int]:
    """Training FLOPs of one sequence by Megatron's formula, per layer type plus 'head'."""
    split = {
        layer_type: _TRAIN * count * _megatron_layer(model, layer_type, seq_len)
        for layer_type, count in _megatron_counts(model).items()
        if count
    }
    h, vocab = model.hidden_size, model.vocab_size
    split["head"] = _TRAIN * 2 * seq_len * h * vocab * (1 + model.mtp_depth)
    return split


def megatron_flops_per_sequence(model: ModelConfig, seq_len: int) -> int:
    """Megatron-LM's training FLOPs for one sequence of ``seq_len`` tokens (T = s, S2 = s^2)."""
    return sum(_megatron_split(model, seq_len).values())


# --------------------------------------------------------------------------- exact forward count
# Each helper returns forward FLOPs per token of one layer at sequence length s.


def _linear(d_in: int, d_out: int, bias: bool) -> int:
    return 2 * d_in * d_out + (d_out if bias else 0)


def _mlp_flops(d: int, width: int, activation: str, bias: bool) -> int:
    """d -> width (x2 when gated) -> d."""
    up = _linear(d, width, bias) * (2 if _swiglu(activation) else 1)
    return up + _linear(width, d, bias)


def _exact_attention(d: int, cfg: AttentionConfig, s: int) -> int:
    q = cfg.heads * cfg.head_dim
    kv = cfg.kv_heads * cfg.head_dim
    projections = _linear(d, q, cfg.bias) + 2 * _linear(d, kv, cfg.bias) + _linear(q, d, cfg.bias)
    # Causal: token i (1-based) attends to i keys, so the mean context is (s + 1) / 2.
    # QK^T and PV each cost 2 * q * context per token: 4 * q * (s + 1) / 2.
    core = 2 * q * (s + 1)
    return projections + core


def _exact_mamba(d: int, cfg: MambaConfig, s: int) -> int:
    """in_proj, depthwise conv1d, the SSD chunked scan and out_proj.

    The SSD scan as executed (mamba_ssm's chunked kernels) with chunk length Q,
    per token: 2*Q*N*groups for the C.B^T block of its chunk row (computed
    whole, then masked), 2*Q*d_inner to apply that block to the chunk's x,
    2*N*d_inner for its share of the chunk-end state (x outer B) and
    2*N*d_inner for the off-diagonal output (C . state). The sequential state
    passing between chunks is O(d_inner*N) per chunk, i.e. /Q per token, and
    elementwise, so it is left out. A sequence shorter than Q is one chunk.
    """
    n, chunk = cfg.state_size, min(cfg.chunk_size, s)
    in_proj = _linear(d, cfg.in_proj_dim, cfg.bias)
    conv = 2 * cfg.conv_kernel * cfg.conv_dim + (cfg.conv_dim if cfg.conv_bias else 0)
    scan = 2 * chunk * n * cfg.groups + 2 * chunk * cfg.d_inner + 4 * n * cfg.d_inner
    out_proj = _linear(cfg.d_inner, d, cfg.bias)
    return in_proj + conv + scan + out_proj


def _exact_moe(d: int, cfg: MoEConfig, mlp_bias: bool) -> int:
    """Router on d, optional latent d->l->d, top_k routed experts at width l (or d), shared."""
    router = 2 * d * cfg.num_experts  # the only term that depends on num_experts
    width = cfg.latent_size or d
    latent = 0
    if cfg.latent_size:
        latent = _linear(d, cfg.latent_size, mlp_bias) + _linear(cfg.latent_size, d, mlp_bias)
    routed = cfg.top_k * _mlp_flops(width, cfg.expert_intermediate_size, cfg.activation, False)
    shared = 0
    if cfg.shared_expert_intermediate_size:
        shared = _mlp_flops(d, cfg.shared_expert_intermediate_size, cfg.activation, mlp_bias)
    return router + latent + routed + shared


def _exact_layer(model: ModelConfig, layer_type: str, s: int) -> int:
    d = model.hidden_size
    if layer_type == "attention" and model.attention is not None:
        return _exact_attention(d, model.attention, s)
    if layer_type == "mamba" and model.mamba is not None:
        return _exact_mamba(d, model.mamba, s)
    if layer_type == "mlp" and model.mlp is not None:
        cfg = model.mlp
        return _mlp_flops(d, cfg.intermediate_size, cfg.activation, cfg.bias)
    if layer_type == "moe" and model.moe is not None:
        return _exact_moe(d, model.moe, mlp_bias=model.mlp.bias if model.mlp else False)
    raise ValueError(f"model has no {layer_type!r} section for its pattern")


def _exact_forward_split(model: ModelConfig, seq_len: int) -> dict[str, int]:
    """Forward FLOPs per token, keyed by FLOPS_KEYS."""
    d, vocab = model.hidden_size, model.vocab_size
    split = dict.fromkeys(FLOPS_KEYS, 0)
    for layer_type, count in model.layout.counts().items():
        if count:
            split[layer_type] = count * _exact_layer(model, layer_type, seq_len)
    head = 2 * d * vocab  # the embedding lookup is a gather, not a FLOP
    split["head"] = head
    if model.mtp_depth:
        inner = sum(_exact_layer(model, LAYER_SYMBOLS[c], seq_len) for c in model.mtp_pattern)
        eh_proj = 2 * (2 * d) * d  # concat[enorm(emb), hnorm(h)] -> d
        split["mtp"] = model.mtp_depth * (eh_proj + inner + head)
    return split


def flops_per_token(model: ModelConfig, seq_len: int) -> FlopsPerToken:
    """Training FLOPs per token of ``model`` on sequences of ``seq_len`` tokens."""
    if seq_len < 1:
        raise ValueError(f"seq_len must be positive, got {seq_len}")
    forward = _exact_forward_split(model, seq_len)
    megatron = _megatron_split(model, seq_len)
    # Every Megatron term is T * x + S2 * y with T = s and S2 = s^2, so the divisions are exact.
    megatron_per_token = {k: v // seq_len for k, v in megatron.items()}
    return FlopsPerToken(
        seq_len=seq_len,
        megatron=sum(megatron_per_token.values()),
        exact=_TRAIN * sum(forward.values()),
        exact_forward=sum(forward.values()),
        by_layer_type={k: _TRAIN * v for k, v in forward.items()},
        megatron_by_layer_type=megatron_per_token,
    )
