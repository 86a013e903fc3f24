"""One tensor of the model, described without torch.

A :class:`TensorSpec` (an immutable named tuple: the Ultra spec has thousands,
and ``factory validate`` builds the spec of every preset) says everything the rest of factory needs to know about
a parameter: its name in the graph's ``state_dict``, its shape, what it is
(:class:`Role`), the dtype it is kept in, how tensor and expert parallelism
split it, how it is initialised, and, for the weights of matrix products, the
GEMM it feeds (:class:`Gemm`). Layer types build these with the small
constructors below, so a shape or a sharding rule is written once.
"""

from __future__ import annotations

from enum import StrEnum
from math import prod
from typing import NamedTuple

__all__ = [
    "Gemm",
    "Init",
    "Role",
    "Split",
    "TensorSpec",
    "conv",
    "expert_linear",
    "linear",
    "norm",
    "vector",
]


class Role(StrEnum):
    """What a tensor is; the planner, precision policy and exports group tensors by it."""

    EMBEDDING = "embedding"
    HEAD = "head"
    LINEAR = "linear"
    """The weight [out, in] of an nn.Linear."""
    LINEAR_BIAS = "linear_bias"
    EXPERT_LINEAR = "expert_linear"
    """A grouped weight [experts, out, in] holding one matrix per routed expert."""
    NORM = "norm"
    CONV = "conv"
    CONV_BIAS = "conv_bias"
    ROUTER = "router"
    ROUTER_BIAS = "router_bias"
    """The aux-loss-free expert bias: ranks experts, never trained by the optimizer."""
    SSM = "ssm"
    """Mamba's per-head A_log, D and dt_bias."""


class Split(NamedTuple):
    """How tensor parallelism splits a tensor: along ``dim``, in ``segments`` split separately.

    ``kind`` is Megatron's vocabulary: ``column`` splits a linear's output
    features, ``row`` its input features, ``vocab`` the vocabulary rows of the
    embedding and head, and ``heads`` a Mamba tensor along its heads and groups.
    ``segments`` are the widths along ``dim`` that shard independently (Mamba's
    in_proj packs [z, x, B, C, dt], each split over the ranks on its own); one
    segment means an even split of the whole dimension.
    """

    kind: str
    dim: int
    segments: tuple[int, ...] = ()


class Init(NamedTuple):
    """An initialisation rule: ``kind`` names it, ``args`` are its numbers.

    Kinds: ``normal`` (std), ``scaled_normal`` (std / sqrt(2 * layers),
    Megatron's scaled init for weights that write into the residual stream),
    ``zeros``, ``ones``, ``conv_uniform`` (PyTorch's default conv init),
    ``a_log`` (log 1..heads), ``dt_bias`` (args: dt_min, dt_max, floor).
    ``factory.graph.init`` implements them.
    """

    kind: str
    args: tuple[float, ...] = ()


class Gemm(NamedTuple):
    """The matrix product a weight feeds: ``in_features`` -> ``out_features``, ``uses`` times
    per token (top_k for routed experts), and whether the precision policy may quantize it."""

    in_features: int
    out_features: int
    uses: int = 1
    quantizable: bool = True


class TensorSpec(NamedTuple):
    name: str
    """Full name, exactly the key in the built graph's ``state_dict``."""
    shape: tuple[int, ...]
    role: Role
    init: Init
    tp: Split | None = None
    """None: every tensor-parallel rank holds all of it (replicated)."""
    expert_dim: int | None = None
    """Dimension of the routed experts, split by expert parallelism."""
    active_experts: int = 0
    """Experts one token uses (top_k), for tensors with an expert dimension."""
    fp32: bool = False
    """Kept in fp32 whatever the model's dtype (the router and its bias)."""
    trainable: bool = True
    gemm: Gemm | None = None
    bias_of: str | None = None
    """For a bias: the name of the weight whose GEMM it is added to."""
    tied_to: str | None = None
    """The tensor this one shares storage with (a tied head); counted once."""

    @property
    def numel(self) -> int:
        return prod(self.shape)

    @property
    def active_numel(self) -> int:
        """Elements one token touches: a routed-expert tensor counts top_k of its experts."""
        if self.expert_dim is None:
            return self.numel
        return self.numel // self.shape[self.expert_dim] * self.active_experts

    @property
    def module(self) -> str:
        """The module path that owns this tensor."""
        return self.name.rpartition(".")[0]

    @property
    def gemm_name(self) -> str:
        """Name of the GEMM in the precision table: a linear's module path, or the grouped
        expert parameter itself (``...mixer.experts.up_proj``), since every expert of a
        projection always shares one format."""
        return self.module if self.role is Role.LINEAR else self.name

    @property
    def shard_class(self) -> str:
        """'expert' (split by EP x ETP), 'dense' (split by TP) or 'replicated'."""
        if self.expert_dim is not None:
            return "expert"
        return "dense" if self.tp is not None else "replicated"

    def forward_flops(self) -> int:
        """Forward FLOPs per token of the product this tensor takes part in (2mnk for a GEMM,
        one per output for a bias, two per tap for a depthwise conv)."""
        if self.gemm is not None:
            g = self.gemm
            return 2 * g.in_features * g.out_features * g.uses
        if self.role is Role.CONV:
            return 2 * self.numel
        if self.role in (Role.CONV_BIAS, Role.LINEAR_BIAS):
            return self.numel * (self.active_experts or 1)
        return 0


_SPLIT_DIM = {"column": 0, "vocab": 0, "heads": 0, "row": 1}
"""The weight dimension each tensor-parallel kind splits ([out, in] weights)."""


def linear(
    module: str,
    in_features: int,
    out_features: int,
    *,
    bias: bool,
    tp: str,
    init: Init,
    quantizable: bool = True,
    role: Role = Role.LINEAR,
    segments: tuple[int, ...] = (),
) -> list[TensorSpec]:
    """An nn.Linear's weight [out, in] and optional bias [out].

    ``tp`` is ``column`` (split outputs; the bias splits with them), ``row``
    (split inputs; the bias is added after the all-reduce, so it is replicated),
    ``vocab`` or ``none``.
    """
    dim = _SPLIT_DIM.get(tp)
    weight_split = None if dim is None else Split(tp, dim, segments if tp != "vocab" else ())
    weight = TensorSpec(
        f"{module}.weight",
        (out_features, in_features),
        role,
        init,
        tp=weight_split,
        gemm=Gemm(in_features, out_features, quantizable=quantizable),
    )
    if not bias:
        return [weight]
    bias_split = weight_split if tp in ("column", "heads") else None
    return [
        weight,
        TensorSpec(
            f"{module}.bias",
            (out_features,),
            Role.LINEAR_BIAS,
            Init("zeros"),
            tp=bias_split,
            bias_of=weight.name,
        ),
    ]


def expert_linear(
    name: str, experts: int, in_features: int, out_features: int, top_k: int, tp: str, init: Init
) -> TensorSpec:
    """One projection of every routed expert, [experts, out, in]; ETP splits it like a linear
    (column on dim 1, row on dim 2) and EP splits dim 0."""
    split = Split("column", 1) if tp == "column" else Split("row", 2)
    return TensorSpec(
        name,
        (experts, out_features, in_features),
        Role.EXPERT_LINEAR,
        init,
        tp=split,
        expert_dim=0,
        active_experts=top_k,
        gemm=Gemm(in_features, out_features, uses=top_k),
    )


def norm(name: str, width: int, split: Split | None = None) -> TensorSpec:
    """An RMSNorm weight; replicated unless ``split`` (Mamba's grouped norm splits by groups)."""
    return TensorSpec(name, (width,), Role.NORM, Init("ones"), tp=split)


def vector(name: str, width: int, role: Role, init: Init, split: Split | None = None) -> TensorSpec:
    return TensorSpec(name, (width,), role, init, tp=split)


def conv(
    module: str, channels: int, kernel: int, *, bias: bool, segments: tuple[int, ...]
) -> list[TensorSpec]:
    """A depthwise conv1d [channels, 1, kernel] (+ bias), split by heads and groups."""
    split = Split("heads", 0, segments)
    out = [
        TensorSpec(
            f"{module}.weight", (channels, 1, kernel), Role.CONV, Init("conv_uniform"), tp=split
        )
    ]
    if bias:
        out.append(
            TensorSpec(
                f"{module}.bias",
                (channels,),
                Role.CONV_BIAS,
                Init("conv_uniform", (kernel,)),
                tp=split,
            )
        )
    return out
