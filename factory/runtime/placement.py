"""The model as this rank holds it: laid out over the run's ranks, and gathered back whole.

:func:`lay_out` shards a compiled model over the ranks of its layout: nothing on
one process but ``training.compile``'s blocks; with one pipeline stage, tensor, expert, context and data
parallelism over the meshes (``factory.distributed.parallelize``); with several,
this rank's stages (``factory.distributed.pipeline_stages``), each parallelized,
behind one :class:`~factory.runtime.pipeline_schedule.PipelinedModel` the
trainer steps. A model compiled ``deferred`` is laid out on the meta device and
then :func:`materialize_shards` gives each rank only its shards, initialised by
the spec's rules or read from ``model.init.checkpoint``
(``factory.distributed.materialize``).

:func:`full_weights` is the reverse, for the end of a run: the whole model's
state dict on rank 0, under the full model's names, gathered from the shards
by PyTorch's own ``get_model_state_dict`` (each DTensor made whole) and, with
pipeline stages, sent to rank 0 over its pipeline group. No second model is
built for it.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from factory.compilation import Compiled, compile_for_training
from factory.distributed.materialize import InitialValues, ValueSource, materialize
from factory.distributed.parallelize import parallelize
from factory.distributed.pipeline_stages import split_stages
from factory.graph.loss import mtp_loss_scale
from factory.graph.weights import CheckpointSlices
from factory.layers.model_spec import model_spec
from factory.runtime.pipeline_schedule import PipelinedModel, PipelineRunner
from factory.runtime.ranks import Ranks

__all__ = ["full_weights", "lay_out", "materialize_shards"]


def lay_out(compiled: Compiled, ranks: Ranks) -> None:
    """Shard ``compiled.model`` in place over ``ranks``' meshes; with pp > 1 it becomes this
    pipeline rank's stages, each sharded, behind one model the trainer steps. With
    ``training.compile`` the blocks are compiled at the layout's point for it (before FSDP2)."""
    meshes = ranks.meshes
    compile_blocks = compiled.blueprint.training.compile
    if meshes is None:
        if compile_blocks:
            compile_for_training(compiled)
        return
    sharded = compiled.blueprint.parallelism.distributed_optimizer
    if meshes.layout.pp == 1:
        parallelize(compiled.model, meshes, sharded, compile_blocks)
        return
    stages = split_stages(compiled.model, meshes.layout, meshes.coordinate("pp"))
    for stage in stages:
        parallelize(stage, meshes, sharded, compile_blocks)
    runner = PipelineRunner(
        stages,
        meshes.layout,
        meshes.dense["pp"],
        mtp_loss_scale(compiled.blueprint.model),
        ranks.device,
        # What the stages send each other: FSDP's param_dtype on CUDA.
        activation_dtype=torch.bfloat16 if meshes.device_type == "cuda" else None,
    )
    compiled.model = PipelinedModel(compiled.blueprint.model, runner)  # type: ignore[assignment]


def materialize_shards(compiled: Compiled, ranks: Ranks, seed: int) -> None:
    """Fill the laid-out, meta-device ``compiled.model``: this rank's shards only, from the
    blueprint's checkpoint or the spec's initial values for ``seed``."""
    cfg = compiled.blueprint.model
    spec = model_spec(cfg)
    source: ValueSource = InitialValues(spec, seed)
    if cfg.init.checkpoint:
        source = CheckpointSlices(Path(cfg.init.checkpoint))
        source.check(spec)
    model = compiled.model
    stages = model.runner.stages if isinstance(model, PipelinedModel) else [model]
    for stage in stages:
        materialize(stage, spec, source, ranks.device)
    if compiled.precision is not None:
        compiled.precision.weights_updated()


def full_weights(model: nn.Module, ranks: Ranks) -> dict[str, torch.Tensor] | None:
    """The whole model's state dict on rank 0 (on the CPU), None on every other rank.

    Collective: every rank of the run calls it at the same point.
    """
    meshes = ranks.meshes
    if meshes is None:
        return {name: value.detach() for name, value in model.state_dict().items()}
    if meshes.layout.pp == 1:
        # cpu_offload: only rank 0 keeps the gathered tensors.
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state = get_model_state_dict(model, options=options)
        return state if ranks.is_main else None
    return _gathered_stages(model, ranks)


def _gathered_stages(model: nn.Module, ranks: Ranks) -> dict[str, torch.Tensor] | None:
    """Every stage's full weights on rank 0: each stage's ranks make them whole, then the
    pipeline group that holds rank 0 sends them to it."""
    assert isinstance(model, PipelinedModel)  # lay_out made it for pp > 1
    meshes = ranks.meshes
    assert meshes is not None
    options = StateDictOptions(full_state_dict=True)
    own: dict[str, torch.Tensor] = {}
    for stage in model.runner.stages:
        own |= {n: t.cpu() for n, t in get_model_state_dict(stage, options=options).items()}
    if any(meshes.coordinate(dim) for dim in ("dp", "cp", "tp")):
        return None  # another pipeline group holds rank 0; its stages are the same
    parts: list[dict[str, torch.Tensor] | None] = [None] * meshes.layout.pp
    group = meshes.dense["pp"].get_group()
    dist.gather_object(own, parts if ranks.is_main else None, dst=0, group=group)
    if not ranks.is_main:
        return None
    return {name: tensor for part in parts if part for name, tensor in part.items()}
