"""Expert parallelism of a whole model: every layer whose type routes tokens to experts shards
them over the EP mesh, as its layer type says (``LayerType.expert_parallel_problems`` and
``apply_expert_parallel``; the MoE's all-to-all dispatch is in
``factory/layers/moe/expert_parallel.py``)."""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from factory.graph.model import held_submodule
from factory.layers.model_spec import model_spec

__all__ = ["apply_expert_parallel"]


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
