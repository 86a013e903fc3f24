"""Apply a layout to a compiled model: tensor, expert, then data parallelism (torchtitan's order).

Tensor parallelism first (DTensor plans from the model spec's sharding rules),
then expert parallelism (routed experts split over the EP group, tokens
exchanged all-to-all), then FSDP2 / DDP over the data-parallel groups, which
wraps the already-distributed parameters. Every rank must hold the same
initialised full model before this (``factory.compile`` with the same seed).
"""

from __future__ import annotations

from torch import nn

from factory.distributed.data_parallel import apply_data_parallel
from factory.distributed.expert_parallel import apply_expert_parallel
from factory.distributed.mesh import Meshes
from factory.distributed.tensor_parallel import apply_tensor_parallel

__all__ = ["parallelize"]


def parallelize(model: nn.Module, meshes: Meshes, distributed_optimizer: bool = True) -> None:
    """Shard ``model`` (a whole model, or one pipeline stage of it) over ``meshes``."""
    layout = meshes.layout
    if layout.tp > 1:
        apply_tensor_parallel(model, meshes.dense["tp"], layout.sequence_parallel)
    if layout.ep > 1:
        apply_expert_parallel(model, meshes.expert["ep"])
    apply_data_parallel(
        model,
        meshes.dense["dp"],
        meshes.expert["edp"],
        shard=distributed_optimizer,
        device_type=meshes.device_type,
    )
