"""The ``model`` section: the hybrid stack and the width of every layer type.

Consumed by ``factory.planner.params`` (parameter counts), ``factory.planner.flops``
and the layer modules themselves. Checks that involve one sub-section only are
validators here; checks that span sections are in ``factory.checks.model_rules``.
Every size is bounded (``factory.schemas.base``), so no blueprint overflows the planner.
"""

from __future__ import annotations

from functools import cached_property
from typing import Literal

from pydantic import Field, field_validator

from factory.schemas.base import (
    MAX_INTERMEDIATE_SIZE,
    MAX_LAYERS,
    MAX_PATTERN_LENGTH,
    ExpertCount,
    HeadCount,
    HeadDim,
    HiddenSize,
    IntermediateSize,
    LayerCount,
    Section,
    SeqLen,
    VocabSize,
)
from factory.schemas.pattern import HybridPattern

__all__ = [
    "AttentionConfig",
    "InitConfig",
    "MLPConfig",
    "MTPConfig",
    "MambaConfig",
    "MoEConfig",
    "ModelConfig",
    "RouterConfig",
]


class AttentionConfig(Section):
    """Grouped-query self-attention (the ``*`` layers)."""

    heads: HeadCount
    """Number of query heads (at most 2**14)."""
    kv_heads: HeadCount
    """Number of key/value heads (query groups); must divide ``heads`` (at most 2**14)."""
    head_dim: HeadDim
    """Width of one head. May differ from hidden_size / heads (Nano: 32 x 128 > 2688).
    At most 2**14."""
    bias: bool = False
    """Biases on the q/k/v/o projections."""


class MambaConfig(Section):
    """Mamba-2 mixer (the ``M`` layers). d_inner = heads x head_dim."""

    heads: HeadCount
    """Number of SSM heads (at most 2**14)."""
    head_dim: HeadDim
    """Channels per SSM head (at most 2**14)."""
    state_size: HeadDim = 128
    """SSM state size N (at most 2**14)."""
    groups: HeadCount = 8
    """Groups sharing B and C; also the group count of the gated RMSNorm (at most 2**14)."""
    conv_kernel: HeadDim = 4
    """Width of the depthwise causal conv1d over x, B and C (at most 2**14)."""
    chunk_size: SeqLen = 128
    """Chunk length of the SSD scan (at most 2**24)."""
    dt_min: float = Field(default=0.001, gt=0)
    """Lower end of the log-uniform dt initialisation."""
    dt_max: float = Field(default=0.1, gt=0)
    """Upper end of the log-uniform dt initialisation."""
    dt_init_floor: float = Field(default=1e-4, gt=0)
    """Floor applied to the initial dt."""
    dt_limit_min: float = Field(default=0.0, ge=0)
    """Lower clamp of dt after softplus."""
    dt_limit_max: float | None = Field(default=None, gt=0)
    """Upper clamp of dt after softplus; null means unbounded."""
    conv_bias: bool = True
    """Bias on the conv1d."""
    bias: bool = False
    """Biases on in_proj and out_proj."""

    @property
    def d_inner(self) -> int:
        return self.heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        """Channels through the conv1d: x, B and C."""
        return self.d_inner + 2 * self.groups * self.state_size

    @property
    def in_proj_dim(self) -> int:
        """Output width of in_proj, packed as [z, xBC, dt]."""
        return 2 * self.d_inner + 2 * self.groups * self.state_size + self.heads


class MLPConfig(Section):
    """Dense MLP (the ``-`` layers)."""

    intermediate_size: IntermediateSize
    """Hidden width of the MLP (ffn_hidden_size; at most 2**20)."""
    activation: Literal["relu2", "swiglu"] = "relu2"
    """relu2 is non-gated squared ReLU (two matrices); swiglu is gated (three)."""
    bias: bool = False
    """Biases on the MLP projections (also used by the shared expert and latent projections)."""


class RouterConfig(Section):
    """The MoE router. It always runs on the full hidden size, in fp32."""

    score_function: Literal["sigmoid", "softmax"] = "sigmoid"
    """How router logits become scores."""
    expert_bias: bool = True
    """Aux-loss-free load balancing: a per-expert bias added to scores for selection only."""
    expert_bias_update_rate: float = Field(default=1e-3, ge=0)
    """Step size of the expert-bias update."""
    normalize_top_k: bool = True
    """Renormalise the chosen scores to sum to one."""
    scaling_factor: float = Field(default=1.0, gt=0)
    """Multiplier on the routing weights (routed_scaling_factor)."""
    num_groups: ExpertCount = 1
    """Expert groups for group-limited routing (1 = off; at most 2**14)."""
    group_top_k: ExpertCount = 1
    """Groups kept per token under group-limited routing (at most 2**14)."""
    aux_loss: Literal["none", "aux_loss", "seq_aux_loss", "global_aux_loss"] = "seq_aux_loss"
    """Auxiliary load-balancing loss."""
    aux_loss_coeff: float = Field(default=1e-4, ge=0)
    """Weight of the auxiliary loss."""


class MoEConfig(Section):
    """Mixture of experts (the ``E`` layers), optionally with a LatentMoE projection."""

    num_experts: ExpertCount
    """Routed experts per MoE layer (at most 2**14)."""
    top_k: ExpertCount
    """Experts chosen per token (at most 2**14)."""
    expert_intermediate_size: IntermediateSize
    """Hidden width of one routed expert (at most 2**20)."""
    shared_expert_intermediate_size: int = Field(default=0, ge=0, le=MAX_INTERMEDIATE_SIZE)
    """Hidden width of the shared expert; 0 means no shared expert (at most 2**20)."""
    latent_size: IntermediateSize | None = None
    """LatentMoE: routed experts run in this width, between d->latent and latent->d projections
    (at most 2**20)."""
    activation: Literal["relu2", "swiglu"] = "relu2"
    """Expert activation."""
    capacity_factor: float | None = Field(default=None, gt=0)
    """Token capacity per expert as a multiple of the balanced load; null means dropless."""
    router: RouterConfig = RouterConfig()
    """Router settings."""


class MTPConfig(Section):
    """Multi-token prediction, DeepSeek-V3 style, with Megatron's repeated-layer mode."""

    depth: LayerCount = 1
    """Number of future tokens predicted (t+2 ... t+1+depth; at most 2**14)."""
    pattern: str = Field(default="*E", max_length=MAX_PATTERN_LENGTH)
    """Inner hybrid pattern of one MTP block (at most 2**16 characters)."""
    repeated: bool = False
    """Apply one stored block at every depth (shared weights) instead of one block per depth."""
    loss_scale: float = Field(default=0.1, ge=0)
    """Weight of the averaged MTP loss."""

    @property
    def stored_blocks(self) -> int:
        """Blocks that hold parameters: one when repeated, else one per depth."""
        return 1 if self.repeated else self.depth


class InitConfig(Section):
    """Parameter initialisation."""

    std: float = Field(default=0.02, gt=0)
    """Standard deviation of the normal init of linear and embedding weights."""
    checkpoint: str | None = None
    """Start from these weights: a Hugging Face checkpoint folder or a .safetensors file."""
    upcycle_from: str | None = None
    """Checkpoint of a dense model whose MLPs seed the experts (dense-to-MoE upcycling)."""


class ModelConfig(Section):
    """The architecture."""

    pattern: str = Field(max_length=MAX_PATTERN_LENGTH)
    """Hybrid layer pattern in Megatron's syntax, e.g. 'MEMEM*EME' or 'M-M*|M-M-/*E/*E'.
    At most 2**14 layers and 2**16 characters."""
    hidden_size: HiddenSize
    """Model width d (at most 2**17)."""
    vocab_size: VocabSize
    """Vocabulary size (embedding rows and head outputs; at most 2**22)."""
    max_seq_len: SeqLen
    """Longest context the model supports (max_position_embeddings; at most 2**24)."""
    norm_eps: float = Field(default=1e-5, gt=0)
    """RMSNorm epsilon."""
    tie_embeddings: bool = False
    """Share the input embedding with the output head."""
    position_embedding: Literal["none", "rope"] = "none"
    """Nemotron-H and Nemotron 3 use none: the Mamba layers carry position."""
    rope_base: float = Field(default=10000.0, gt=0)
    """RoPE base frequency; used only with position_embedding: rope."""
    rope_fraction: float = Field(default=1.0, gt=0, le=1)
    """Fraction of each head's channels rotated by RoPE."""
    init: InitConfig = InitConfig()
    """Initialisation."""
    attention: AttentionConfig | None = None
    """Required when the pattern has '*'."""
    mamba: MambaConfig | None = None
    """Required when the pattern has 'M'."""
    mlp: MLPConfig | None = None
    """Required when the pattern has '-'."""
    moe: MoEConfig | None = None
    """Required when the pattern has 'E'."""
    mtp: MTPConfig | None = None
    """Multi-token prediction; may instead be written as '/' segments in the pattern."""

    @field_validator("pattern")
    @classmethod
    def _pattern_parses(cls, value: str) -> str:
        parsed = HybridPattern.parse(value)  # raises PatternError (a ValueError) with the position
        if parsed.num_layers > MAX_LAYERS:
            raise ValueError(f"{parsed.num_layers} layers; at most {MAX_LAYERS} are supported")
        return value

    @cached_property
    def parsed_pattern(self) -> HybridPattern:
        """The parsed pattern."""
        return HybridPattern.parse(self.pattern)

    @property
    def num_layers(self) -> int:
        return self.parsed_pattern.num_layers

    @property
    def mtp_depth(self) -> int:
        """MTP depth from the pattern's '/' segments, else from the mtp section."""
        if self.parsed_pattern.mtp_depth:
            return self.parsed_pattern.mtp_depth
        return self.mtp.depth if self.mtp else 0

    @property
    def mtp_pattern(self) -> str:
        if self.parsed_pattern.mtp:
            return self.parsed_pattern.mtp[0]
        return self.mtp.pattern if self.mtp else ""

    @property
    def mtp_stored_blocks(self) -> int:
        """MTP blocks that own parameters."""
        if not self.mtp_depth:
            return 0
        repeated = self.mtp.repeated if self.mtp else False
        return 1 if repeated else self.mtp_depth
