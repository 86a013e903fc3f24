"""Apply a layout to a model: tensor, expert, then data parallelism (torchtitan's order).

Tensor parallelism first (DTensor plans from the model spec's sharding rules),
then expert parallelism (every layer whose type routes tokens to experts shards
them over the EP group, as its layer type says: ``LayerType.expert_parallel_problems``
and ``apply_expert_parallel``), then context parallelism (every layer takes its
type's ``context_parallel`` style over the CP group; weights are not split), then
FSDP2 / DDP over the data-parallel and context-parallel ranks together, which wraps
the already-distributed parameters. Every rank must hold the same
initialised full model before this (``factory.compile`` with the same seed).

Pipeline stages are cut before this (``factory.distributed.pipeline_stages``) and
each stage is parallelized on its own; the training runtime puts them behind one
model (``factory.runtime.placement``).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from factory.distributed.data_parallel import apply_data_parallel
from factory.distributed.mesh import Meshes
from factory.distributed.tensor_parallel import apply_tensor_parallel
from factory.graph.hybrid_lm import held_submodule
from factory.layers.model_spec import model_spec
from factory.nn.sequence_split import SequenceSplit

__all__ = ["apply_context_parallel", "apply_expert_parallel", "parallelize"]


def parallelize(model: nn.Module, meshes: Meshes, distributed_optimizer: bool = True) -> None:
    """Shard ``model`` (a whole model, or one pipeline stage of it) over ``meshes``."""
    layout = meshes.layout
    if layout.tp > 1:
        apply_tensor_parallel(model, meshes.dense["tp"], layout.sequence_parallel)
    if layout.ep > 1:
        apply_expert_parallel(model, meshes.expert["ep"])
    if layout.cp > 1:
        apply_context_parallel(model, meshes.dense["cp"], layout.tp)
    # Context-parallel ranks hold the same weights and different tokens: their gradients
    # are reduced with the data-parallel replicas' (Megatron's DP-CP group).
    apply_data_parallel(
        model,
        meshes.tokens,
        meshes.expert["edp"],
        shard=distributed_optimizer,
        device_type=meshes.device_type,
    )


def apply_context_parallel(model: nn.Module, cp_mesh: DeviceMesh, tp: int = 1) -> None:
    """Make ``model`` (a whole model or a pipeline stage of one, split over ``tp`` tensor-
    parallel ranks already) compute this rank's chunks of every sequence over the 1-D
    ``cp_mesh``: the model selects them (``sequence_split``) and every layer's mixer takes
    its layer type's context-parallel style (``LayerType.apply_context_parallel``). Raises
    ValueError, leaving the model untouched, when a layer cannot split (``cp_rules``)."""
    split = SequenceSplit(cp_mesh.get_group())
    layers = [
        (layer, block.mixer)
        for layer in model_spec(model.cfg).layers
        if (block := held_submodule(model, layer.prefix)) is not None
    ]
    problems = [
        f"{layer.prefix}.mixer: {problem}"
        for layer, _ in layers
        for problem in layer.type.cp_rules(model.cfg, tp, split.size)
    ]
    if problems:
        raise ValueError("; ".join(dict.fromkeys(problems)))
    for layer, mixer in layers:
        layer.type.apply_context_parallel(mixer, split)
    model.sequence_split = split


def apply_expert_parallel(model: nn.Module, ep_mesh: DeviceMesh) -> None:
    """Shard every routing layer's experts of ``model`` (main stack and MTP; a whole model or
    a pipeline stage of one) over the 1-D ``ep_mesh`` (``meshes.expert["ep"]``).

    Expects the initialised full model on every rank, identical across the EP group
    (``factory.compile`` with one seed does that). Call before FSDP, which then shards the
    local experts over the expert-data-parallel ranks. Raises ValueError, leaving the model
    untouched, when any layer cannot be split (an expert count that is not a multiple of
    the EP size, a layer already expert-parallel).
    """
    if ep_mesh.ndim != 1:
        raise ValueError(f"ep_mesh must be 1-D (meshes.expert['ep']), got {ep_mesh.ndim} dims")
    layers = [
        (layer, block.mixer)
        for layer in model_spec(model.cfg).layers
        if (block := held_submodule(model, layer.prefix)) is not None
    ]
    problems = [
        f"{layer.prefix}.mixer: {problem}"
        for layer, mixer in layers
        for problem in layer.type.expert_parallel_problems(mixer, ep_mesh.size())
    ]
    if problems:  # every layer is checked before any changes
        raise ValueError("; ".join(problems))
    for layer, mixer in layers:
        layer.type.apply_expert_parallel(mixer, ep_mesh)
