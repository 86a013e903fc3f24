"""The training loop's questions to the other ranks (``factory.runtime.ranks.Ranks``), answered
over torch.distributed.

Groups, from the layout's meshes (``factory.distributed.mesh``):

* data: the dense grid's ``dp`` dimension, over which the global batch is split
  (losses and target-token counts are summed over it);
* routing: the data-parallel group as well: with sequence parallelism each TP
  rank routes its own part of the sequence, and tensor parallelism already sums
  the loads over the TP group in the forward pass
  (``factory.distributed.tensor_parallel``), so every TP rank moves its expert
  biases alike;
* pipeline: the ``pp`` dimension; stages hold different layers, so per-layer
  statistics are gathered over it, and gradient norms summed.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from factory.distributed.mesh import Meshes

__all__ = ["DistributedRanks"]


def _replicas(grad: torch.Tensor, stage_ranks: int) -> int:
    """How many ranks hold this very shard: the mesh dims it is replicated over (a plain
    tensor is held whole by every rank of its stage)."""
    if not isinstance(grad, DTensor):
        return stage_ranks
    held = 1
    for size, placement in zip(grad.device_mesh.shape, grad.placements, strict=True):
        if isinstance(placement, Replicate):
            held *= size
    return held


class DistributedRanks:
    """:class:`~factory.runtime.ranks.Ranks` over the process group of ``meshes``."""

    def __init__(self, meshes: Meshes) -> None:
        self.meshes = meshes
        # NCCL reduces device tensors, gloo host tensors.
        self._device = (
            torch.device("cuda", torch.cuda.current_device())
            if meshes.device_type == "cuda"
            else torch.device("cpu")
        )
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.data_rank = meshes.coordinate("dp")
        self.data_size = meshes.layout.dp
        self._data = meshes.dense["dp"].get_group()
        self._pipeline = meshes.dense["pp"].get_group()
        layout = meshes.layout
        self._stage_ranks = layout.dp * layout.cp * layout.tp

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def sum_over_data(self, value: torch.Tensor) -> torch.Tensor:
        total = value.detach().to(self._device, copy=True)
        dist.all_reduce(total, group=self._data)
        return total.to(value.device)

    def _gather_stages(self, values: dict[str, Any]) -> dict[str, Any]:
        """Every stage's per-layer values on every rank (stages hold different layers)."""
        if self.meshes.layout.pp == 1:
            return values
        gathered: list[Any] = [None] * self.meshes.layout.pp
        dist.all_gather_object(gathered, values, self._pipeline)
        merged = {n: v for part in gathered for n, v in part.items()}
        return {n: merged[n] for n in sorted(merged)}

    def mean_over_data(self, values: dict[str, float]) -> dict[str, float]:
        names = sorted(values)
        if names:
            stacked = torch.tensor([values[n] for n in names], dtype=torch.float64)
            stacked = self.sum_over_data(stacked) / self.data_size
            values = dict(zip(names, stacked.tolist(), strict=True))
        return self._gather_stages(values)

    def sum_over_routing(self, loads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        names = sorted(loads)
        if names:
            stacked = torch.stack([loads[n].to(self._device, torch.int64) for n in names])
            dist.all_reduce(stacked, group=self._data)
            loads = dict(zip(names, stacked.unbind(0), strict=True))
        if self.meshes.layout.pp == 1:
            return {n: t.cpu() for n, t in loads.items()}
        lists = self._gather_stages({n: t.tolist() for n, t in loads.items()})
        return {n: torch.tensor(v) for n, v in lists.items()}

    def grad_norm(self, params: Iterable[nn.Parameter]) -> torch.Tensor:
        """Sum of squares of every local shard, divided by how many ranks hold that shard,
        summed over all ranks: each element of the model counted exactly once."""
        total = torch.zeros((), dtype=torch.float64, device=self._device)
        for param in params:
            grad = param.grad
            if grad is None:
                continue
            local = grad.to_local() if isinstance(grad, DTensor) else grad
            squares = local.detach().double().square().sum().to(self._device)
            total += squares / _replicas(grad, self._stage_ranks)
        dist.all_reduce(total)
        return total.sqrt().float()

    def agree(self, value: Any) -> Any:
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        dist.barrier()
