"""The optimizer's parameter groups under FSDP: what CUDA's foreach AdamW needs, on CPU."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn

from factory.runtime.optimizer import MasterOptimizer
from factory.schemas.training import OptimizerConfig


@pytest.fixture
def one_rank() -> Iterator[None]:
    """A one-rank gloo group in this process."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_foreach_adamw_steps_dtensors_beside_plain_tensors(one_rank: None) -> None:
    """FSDP shards one module and leaves another alone (as it leaves the experts of a single
    expert-data-parallel replica): AdamW's foreach path, CUDA's default, takes each group
    at once and refuses DTensors mixed with plain tensors, so the groups must not mix."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 4))
    fully_shard(model[0], mesh=init_device_mesh("cpu", (1,)))
    optimizer = MasterOptimizer(model, OptimizerConfig(lr=1e-2))
    for group in optimizer.optimizer.param_groups:
        group["foreach"] = True  # what torch picks on CUDA
        assert len({hasattr(p, "device_mesh") for p in group["params"]}) == 1
    before = [p.detach().clone() for p in model[2].parameters()]
    model(torch.randn(3, 4)).square().sum().backward()
    optimizer.step()
    assert all(not torch.equal(a, p) for a, p in zip(before, model[2].parameters(), strict=True))
