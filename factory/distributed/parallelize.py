"""Apply a layout to a compiled model: tensor, expert, then data parallelism (torchtitan's order).

Tensor parallelism first (DTensor plans from the model spec's sharding rules),
then expert parallelism (routed experts split over the EP group, tokens
exchanged all-to-all), then FSDP2 / DDP over the data-parallel groups, which
wraps the already-distributed parameters. Every rank must hold the same
initialised full model before this (``factory.compile`` with the same seed).

:func:`parallelize_compiled` is what a training job calls: with pipeline stages it
first splits the model into this rank's stages, shards each, and puts them
behind one :class:`~factory.distributed.pipelined_model.PipelinedModel`.
"""

from __future__ import annotations

import torch
from torch import nn

from factory.compilation import Compiled
from factory.distributed.data_parallel import apply_data_parallel
from factory.distributed.expert_parallel import apply_expert_parallel
from factory.distributed.mesh import Meshes
from factory.distributed.pipeline import PipelineRunner
from factory.distributed.pipeline_stages import split_stages
from factory.distributed.pipelined_model import PipelinedModel
from factory.distributed.tensor_parallel import apply_tensor_parallel
from factory.runtime.loop import mtp_loss_scale

__all__ = ["parallelize", "parallelize_compiled"]


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


def parallelize_compiled(compiled: Compiled, meshes: Meshes, device: str) -> None:
    """Shard ``compiled.model`` in place over ``meshes``; with pp > 1 it becomes this pipeline
    rank's stages, each sharded, behind one model the training loop steps."""
    sharded = compiled.blueprint.parallelism.distributed_optimizer
    if meshes.layout.pp == 1:
        parallelize(compiled.model, meshes, sharded)
        return
    stages = split_stages(compiled.model, meshes.layout, meshes.coordinate("pp"))
    for stage in stages:
        parallelize(stage, meshes, sharded)
    runner = PipelineRunner(
        stages, meshes.layout, meshes.dense["pp"], mtp_loss_scale(compiled), device,
        # What the stages send each other: FSDP's param_dtype on CUDA.
        activation_dtype=torch.bfloat16 if meshes.device_type == "cuda" else None,
    )  # fmt: skip
    compiled.model = PipelinedModel(compiled.blueprint.model, runner)  # type: ignore[assignment]
