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
from factory.layers.model_spec import model_spec
from factory.planner.layout import resolve_layout
from factory.planner.runtime_memory import runtime_state_per_rank
from factory.schemas.blueprint import Blueprint


def _blueprint(world: int, **parallelism: Any) -> Blueprint:
    return tiny_blueprint(
        parallelism={"world_size": world, "global_batch_size": 2 * GLOBAL, **parallelism}
    )


def _local_bytes(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


def _held(rank: int, world: int, bp: Blueprint) -> dict[str, int]:
    from factory.distributed.mesh import build_meshes
    from factory.distributed.parallelize import parallelize
    from factory.runtime.optimizer import MasterOptimizer

    compiled = factory.compile(bp, precision="off", seed=0)
    parallelize(compiled.model, build_meshes(resolve_layout(bp), "cpu"),
                bp.parallelism.distributed_optimizer)  # fmt: skip
    optimizer = MasterOptimizer(compiled.model, bp.training.optimizer)
    ids = torch.randint(
        0, bp.model.vocab_size, (2, 32), generator=torch.Generator().manual_seed(rank)
    )
    output = compiled.model(ids)
    # Every trainable tensor gets a gradient: the MTP heads' logits and the aux loss count too.
    loss = sum(t.float().square().mean() for t in (output.logits, *output.mtp_logits))
    (loss + output.aux_loss).backward()
    optimizer.step()
    params = list(compiled.model.parameters())
    moments = [v for s in optimizer.optimizer.state.values() for k, v in s.items() if k != "step"]
    return {
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
    ],
)
def test_each_rank_holds_the_planned_state(world: int, parallelism: dict[str, Any]) -> None:
    bp = _blueprint(world, **parallelism)
    plan = runtime_state_per_rank(bp, resolve_layout(bp))
    held = run_ranks(_held, world, bp, timeout=180)
    # One first-dimension row per tensor: how far FSDP2's chunks may stray from a share.
    slack = sum(4 * t.numel // t.shape[0] for t in model_spec(bp.model).tensors())
    for kind in ("weights", "gradients", "optimizer"):
        planned: Fraction = getattr(plan, kind)
        assert sum(rank[kind] for rank in held) == planned * world, kind
        for rank in held:
            assert abs(rank[kind] - planned) <= (2 if kind == "optimizer" else 1) * slack, kind
