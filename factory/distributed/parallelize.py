"""Apply a layout to a model: tensor, expert, context, compile, then data parallelism
(torchtitan's order).

Tensor parallelism first (DTensor plans from the model spec's sharding rules),
then expert parallelism (every layer whose type routes tokens to experts shards
them over the expert grid's EP and ETP groups, as its layer type says:
``LayerType.expert_parallel_problems`` and ``apply_expert_parallel``), then context
parallelism (every layer takes its type's ``context_parallel`` style over the CP
group; weights are not split), then, with ``training.compile``, ``torch.compile`` per
block (``factory.graph.block_compile``: after the rewrites above, so the graphs trace
them, and before FSDP2, whose hooks stay out of the graphs, as torchtitan does), then
FSDP2 / DDP over the data-parallel and context-parallel ranks together, which wraps the
already-distributed parameters.

Pipeline stages are cut before this (``factory.distributed.pipeline_stages``) and
each stage is parallelized on its own; the training runtime puts them behind one
model (``factory.runtime.placement``).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from factory.distributed.data_parallel import apply_data_parallel
from factory.distributed.mesh import Meshes
from factory.distributed.tensor_parallel import apply_tensor_parallel, runs_local_views
from factory.graph.block_compile import compile_blocks
from factory.graph.hybrid_lm import held_submodule
from factory.layers.model_spec import LayerSpec, model_spec
from factory.nn.sequence_split import SequenceSplit

__all__ = ["apply_context_parallel", "apply_expert_parallel", "parallelize"]


def parallelize(
    model: nn.Module, meshes: Meshes, distributed_optimizer: bool = True, compile: bool = False
) -> None:
    """Shard ``model`` (a whole model, or one pipeline stage of it) over ``meshes``;
    ``compile`` compiles its blocks before the data-parallel wrap."""
    layout = meshes.layout
    if layout.tp > 1:
        apply_tensor_parallel(model, meshes.dense["tp"], layout.sequence_parallel)
    if layout.ep * layout.etp > 1:
        apply_expert_parallel(model, meshes.expert["ep", "etp"])
    if layout.cp > 1:
        apply_context_parallel(model, meshes.dense["cp"], layout.tp)
    if compile:
        compile_blocks(model, keep_eager=runs_local_views)
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
    layers = _held_mixers(model)
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


def apply_expert_parallel(model: nn.Module, expert_mesh: DeviceMesh) -> None:
    """Shard every routing layer's experts of ``model`` (main stack and MTP; a whole model or
    a pipeline stage of one) over the 2-D ``expert_mesh`` (``meshes.expert["ep", "etp"]``):
    experts over ``ep``, each expert's matrices over ``etp``, as the spec splits them.

    Expects the model on the meta device (``factory.compile(deferred=True)``; its shards are
    filled afterwards) or the initialised full model on every rank, identical across the
    expert grid (``factory.compile`` with one seed does that). Call before FSDP, which then shards the
    local experts over the expert-data-parallel ranks. Raises ValueError, leaving the model
    untouched, when any layer cannot be split (an expert count that is not a multiple of
    the EP size, an expert width that is not a multiple of the ETP size, a layer already
    expert-parallel).
    """
    if expert_mesh.mesh_dim_names != ("ep", "etp"):
        raise ValueError(
            "expert_mesh must be the expert grid's 2-D (ep, etp) mesh "
            f"(meshes.expert['ep', 'etp']), got dims {expert_mesh.mesh_dim_names}"
        )
    ep, etp = expert_mesh["ep"].size(), expert_mesh["etp"].size()
    layers = _held_mixers(model)
    problems = [
        f"{layer.prefix}.mixer: {problem}"
        for layer, mixer in layers
        for problem in layer.type.expert_parallel_problems(mixer, ep, etp)
    ]
    if problems:  # every layer is checked before any changes
        raise ValueError("; ".join(problems))
    for layer, mixer in layers:
        under = f"{layer.prefix}.mixer."
        routed = {
            t.name.removeprefix(under): t
            for t in layer.tensors
            if t.expert_dim is not None and t.name.startswith(under)
        }
        layer.type.apply_expert_parallel(mixer, expert_mesh, routed)


def _held_mixers(model: nn.Module) -> list[tuple[LayerSpec, nn.Module]]:
    """Each layer of ``model``'s spec that this model (or pipeline stage) holds, with its mixer."""
    return [
        (layer, block.mixer)
        for layer in model_spec(model.cfg).layers
        if (block := held_submodule(model, layer.prefix)) is not None
    ]
