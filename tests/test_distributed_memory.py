"""The model state each rank really holds equals ``factory.planner.runtime_memory``'s plan.

For each layout the ranks build the tiny model, shard it, take one optimizer
step (so Adam's moments exist) and count the bytes of their local shards of
parameters, gradients and optimizer state. Summed over the ranks they equal the
plan's per-rank share times the world size exactly; each rank's own count is
the plan's share up to FSDP2's chunking (at most one first-dimension row per
tensor).
"""

from __future__ import annotations

from fractions import Fraction
from typing import Any

import pytest
import torch
from runtime_helpers import GLOBAL, tiny_blueprint
from torch.distributed.tensor import DTensor

import factory
from factory.distributed.local import run_ranks
from factory.distributed.mesh import build_meshes
from factory.graph.loss import mtp_loss_scale
from factory.layers.model_spec import model_spec
from factory.planner.layout import resolve_layout
from factory.planner.runtime_memory import runtime_state_by_stage
from factory.runtime.batches import MicroBatch
from factory.runtime.optimizer import MasterOptimizer
from factory.runtime.placement import lay_out, materialize_shards
from factory.runtime.ranks import DistributedRanks
from factory.runtime.step import forward_backward
from factory.schemas.blueprint import Blueprint


def _blueprint(world: int, average: bool = False, **parallelism: Any) -> Blueprint:
    bp = tiny_blueprint(
        parallelism={"world_size": world, "global_batch_size": 2 * GLOBAL, **parallelism},
        training={"average": {"decay": 0.9}} if average else {},
    )
    if parallelism.get("pp", 1) == 1:
        return bp
    data = bp.model_dump(exclude_unset=True)
    data["model"]["pattern"] = "ME|M*E"  # one segment per stage
    return Blueprint.model_validate(data)


def _local_bytes(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


def _held(rank: int, world: int, bp: Blueprint) -> dict[str, int]:
    """Build, lay out and fill the model as a training run does, take one step through the
    runtime's step (a pipeline's schedule for pp > 1), and count the local bytes."""
    layout = resolve_layout(bp)
    ranks = DistributedRanks(build_meshes(layout, "cpu"))
    compiled = factory.compile(bp, precision="off", seed=0, deferred=True)
    lay_out(compiled, ranks)
    materialize_shards(compiled, ranks, seed=0)
    optimizer = MasterOptimizer(compiled.model, bp.training.optimizer, bp.training.average)
    gen = torch.Generator().manual_seed(ranks.data_rank)
    par = bp.parallelism
    count = par.global_batch_size // par.micro_batch_size // ranks.data_size
    micro = []
    for _ in range(count):
        ids = torch.randint(0, bp.model.vocab_size, (bp.parallelism.micro_batch_size, 32),
                            generator=gen)  # fmt: skip
        micro.append(MicroBatch(ids, torch.ones_like(ids, dtype=torch.bool)))
    forward_backward(compiled.model, micro, mtp_loss_scale(bp.model), ranks)
    optimizer.grads_to_masters()
    optimizer.step()
    optimizer.update_average(0)
    params = list(compiled.model.parameters())
    moments = [v for s in optimizer.optimizer.state.values() for k, v in s.items() if k != "step"]
    moments += optimizer.averages  # training.average's moving average, where kept
    return {
        "pp_rank": ranks.meshes.coordinate("pp"),
        "weights": sum(_local_bytes(p) for p in params),
        "gradients": sum(_local_bytes(p.grad) for p in params if p.grad is not None),
        "optimizer": sum(_local_bytes(m) for m in moments),
    }


@pytest.mark.parametrize(
    ("world", "parallelism"),
    [
        pytest.param(2, {}, id="dp2-fsdp"),
        pytest.param(2, {"distributed_optimizer": False}, id="dp2-ddp"),
        pytest.param(2, {"ep": 2}, id="ep2"),
        pytest.param(4, {"ep": 2}, id="dp2xep2-folded"),
        pytest.param(2, {"etp": 2}, id="etp2"),
        pytest.param(4, {"etp": 2}, id="edp2xetp2-folded"),
        pytest.param(2, {"pp": 2}, id="pp2"),
        pytest.param(2, {"cp": 2}, id="cp2"),
        pytest.param(2, {"average": True}, id="dp2-fsdp-average"),
    ],
)
def test_each_rank_holds_the_planned_state(world: int, parallelism: dict[str, Any]) -> None:
    bp = _blueprint(world, **parallelism)
    layout = resolve_layout(bp)
    plans = runtime_state_by_stage(bp, layout)
    held = run_ranks(_held, world, bp, timeout=180)
    # One first-dimension row per tensor: how far FSDP2's chunks may stray from a share.
    slack = sum(4 * t.numel // t.shape[0] for t in model_spec(bp.model).tensors())
    for kind in ("weights", "gradients", "optimizer"):
        total = sum(getattr(plan, kind) for plan in plans) * (world // layout.pp)
        assert sum(rank[kind] for rank in held) == total, kind
        for rank in held:
            planned: Fraction = getattr(plans[rank["pp_rank"]], kind)
            kept = 2 + (bp.training.average is not None)  # Adam's moments, the average
            assert abs(rank[kind] - planned) <= (kept if kind == "optimizer" else 1) * slack, kind
