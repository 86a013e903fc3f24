"""Bytes of model state each rank of factory's own distributed runtime holds.

``factory.planner.memory`` plans Megatron's accounting (BF16 weights, FP32
gradients, a distributed optimizer sharding FP32 masters and Adam states): what
the exported job will hold on the cluster. Factory's runtime
(``factory.distributed``) keeps the parameters themselves in FP32 as the
optimizer's masters and shards differently, so it is planned here, tensor by
tensor from the model spec, and ``tests/test_distributed_memory.py`` checks the
plan against what the ranks really hold:

* a pipeline rank holds its stages' layers (``layout.layer_indices_on_rank``), the
  first rank the embedding, the last the final norm, head and MTP blocks, and a
  copy of the embedding where MTP or a tied head needs it;
* context parallelism splits no tensor: its ranks are data-parallel replicas of
  the weights (FSDP2 shards over DP and CP together);
* tensor parallelism splits a tensor the spec splits (``tp``) over TP;
* routed-expert tensors split over EP (whole experts) and ETP (each expert's ffn:
  up and gate by columns, down by rows), whatever TP the dense layers use;
* FSDP2 (``distributed_optimizer``) shards every trainable tensor again over
  its data-parallel group: DP for dense tensors, EDP for experts; DDP does not;
* a frozen tensor (the aux-loss-free expert bias) is held whole by every rank,
  with no gradient and no optimizer state;
* weights and gradients are FP32 (4 bytes), Adam keeps two FP32 moments (8), and
  ``training.average`` an FP32 moving average beside them, sharded alike (4).

FSDP2 splits a tensor's first dimension into ``ceil(n / d)``-row chunks, so a
rank holds its exact share only up to one row per tensor: the plan gives the
exact share (a fraction), summed over the ranks it is exact.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from factory.layers.model_spec import model_spec
from factory.planner.layout import Layout
from factory.schemas.blueprint import Blueprint
from factory.spec.tensors import TensorSpec

__all__ = ["RuntimeState", "runtime_state_by_stage", "runtime_state_per_rank"]

FP32 = 4


@dataclass(frozen=True)
class RuntimeState:
    """Bytes of one rank's share of the model state (fractions: exact shares)."""

    weights: Fraction
    gradients: Fraction
    optimizer: Fraction

    @property
    def total(self) -> Fraction:
        return self.weights + self.gradients + self.optimizer


def _on_stage(tensor: TensorSpec, bp: Blueprint, layout: Layout, pp_rank: int) -> bool:
    """Whether pipeline rank ``pp_rank`` holds ``tensor`` (``factory.distributed.pipeline_stages``)."""
    last = pp_rank == layout.pp - 1
    parts = tensor.name.split(".")
    if parts[:2] == ["backbone", "layers"]:
        return int(parts[2]) in layout.layer_indices_on_rank(pp_rank)
    if parts[:2] == ["backbone", "embeddings"]:
        copy = bp.model.mtp_depth > 0 or bp.model.tie_embeddings
        return pp_rank == 0 or (last and copy)
    return last  # the final norm, the head and the MTP blocks


def runtime_state_per_rank(bp: Blueprint, layout: Layout, pp_rank: int = 0) -> RuntimeState:
    """The exact share of weights, gradients and Adam state on a rank of pipeline rank
    ``pp_rank``."""
    sharded = bp.parallelism.distributed_optimizer
    weights = trainable = Fraction(0)
    for tensor in model_spec(bp.model).tensors():
        if tensor.tied_to is not None or not _on_stage(tensor, bp, layout, pp_rank):
            continue
        share = Fraction(tensor.numel)
        if tensor.expert_dim is not None:
            share /= layout.ep * layout.etp
            replicas = layout.edp
        else:
            share /= layout.tp if tensor.tp is not None else 1
            replicas = layout.dp * layout.cp
        if not tensor.trainable:
            weights += share
            continue
        share /= replicas if sharded else 1
        weights += share
        trainable += share
    kept = 2 + (bp.training.average is not None)  # Adam's moments, and the moving average
    return RuntimeState(FP32 * weights, FP32 * trainable, kept * FP32 * trainable)


def runtime_state_by_stage(bp: Blueprint, layout: Layout) -> list[RuntimeState]:
    """:func:`runtime_state_per_rank` for every pipeline rank, in order."""
    return [runtime_state_per_rank(bp, layout, rank) for rank in range(layout.pp)]
