"""The device meshes of a layout: one for the dense layers, one for the experts, same ranks.

MoE parallel folding (Megatron-Core; ``docs/parallelism.md``) factorises the
ranks twice. Dense layers (attention, Mamba, MLP, embedding, head) see the
grid ``(pp, dp, cp, tp)``; MoE experts see ``(pp, edp, ep, etp)``. Both are
row-major over the global ranks with the innermost dimension fastest, which is
Megatron's default ``tp-cp-ep-dp-pp`` order: TP (and EP) neighbours are
adjacent ranks, so they stay inside one NVLink domain, and the two grids share
their pipeline groups exactly.

``torch.distributed.device_mesh.DeviceMesh`` builds each grid's process
groups; the runtime takes its sub-meshes by name (``meshes.dense["tp"]``).
The ranks that hold distinct tokens of a step are the data-parallel replicas
and, within each, the context-parallel shards of its sequences: ``meshes.tokens``
flattens ``dp`` and ``cp`` into one dimension (Megatron's DP-CP group), over
which losses are summed and dense gradients reduced.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh

from factory.planner.layout import Layout

__all__ = ["DENSE_DIMS", "EXPERT_DIMS", "Meshes", "build_meshes", "grid_ranks"]

DENSE_DIMS = ("pp", "dp", "cp", "tp")
EXPERT_DIMS = ("pp", "edp", "ep", "etp")


def grid_ranks(layout: Layout, expert: bool = False) -> torch.Tensor:
    """The global rank at every coordinate of the dense (or expert) grid."""
    shape = (
        (layout.pp, layout.edp, layout.ep, layout.etp)
        if expert
        else (layout.pp, layout.dp, layout.cp, layout.tp)
    )
    return torch.arange(layout.world_size).reshape(shape)


@dataclass(frozen=True)
class Meshes:
    """The two factorisations of the same ranks (``layout`` says their sizes)."""

    layout: Layout
    dense: DeviceMesh
    """Dims ``pp, dp, cp, tp``: attention, Mamba, MLP, norms, embedding and head."""
    expert: DeviceMesh
    """Dims ``pp, edp, ep, etp``: the routed experts of the MoE layers."""
    tokens: DeviceMesh
    """``dp`` and ``cp`` flattened: the ranks that hold distinct tokens of a step."""

    @property
    def device_type(self) -> str:
        return self.dense.device_type

    def coordinate(self, dim: str) -> int:
        """This rank's index along a named dimension of either grid."""
        mesh = self.dense if dim in DENSE_DIMS else self.expert
        return mesh.get_local_rank(dim)


def build_meshes(layout: Layout, device_type: str) -> Meshes:
    """Both meshes of ``layout`` over the default process group (every rank calls this)."""
    dense = DeviceMesh(device_type, grid_ranks(layout), mesh_dim_names=DENSE_DIMS)
    expert = DeviceMesh(device_type, grid_ranks(layout, expert=True), mesh_dim_names=EXPERT_DIMS)
    tokens = dense["dp", "cp"]._flatten("dp_cp") if layout.cp > 1 else dense["dp"]
    return Meshes(layout=layout, dense=dense, expert=expert, tokens=tokens)
