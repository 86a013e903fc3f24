"""Materialize a model laid out on the meta device: each rank fills only the shards it holds.

The model is built on ``meta`` (``factory.compile(..., deferred=True)``), laid out
(tensor, expert, context and data parallelism, pipeline stages: nothing is allocated
yet), then :func:`materialize` gives every parameter its storage on the rank's
device and writes into it this rank's part of the tensor's value, from a
:class:`ValueSource`:

* :class:`InitialValues`: the spec's init rule, drawn per tensor (and per routed
  expert) from generators seeded by the run's seed and the name
  (``factory.graph.init``): any layout gets the values one process draws, bit for
  bit. A rank draws one whole tensor at a time and keeps its slice, and draws
  only the experts it holds, one at a time: its peak is its shards plus one
  tensor (or one expert) of scratch;
* :class:`CheckpointSlices`: a Hugging Face checkpoint (``model.init.checkpoint``),
  of which each rank reads only its slices from the safetensors files (a ``.pt``
  file is read whole, there being no way to read part of one).

Which part of the canonical tensor a rank holds, dimension by dimension, follows
from the parameter's DTensor placements (each index vector is the rank's shard of
``arange``, distributed as the parameter is), composed with the rank-major
order tensor parallelism gives Mamba's packed projections
(``factory.distributed.tensor_parallel.canonical_order``).
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from factory.distributed.tensor_parallel import canonical_order
from factory.graph.init import expert_initial_value, initial_value
from factory.graph.weights import CheckpointSlices, take
from factory.layers.model_spec import ModelSpec
from factory.spec.tensors import TensorSpec

__all__ = ["CheckpointSlices", "InitialValues", "ValueSource", "local_index", "materialize"]

Index = list[torch.Tensor | None]
"""Per dimension, the canonical indices a rank holds (None: all of them, in order)."""


class ValueSource(Protocol):
    """Where a tensor's values come from, read a part at a time."""

    def read(self, tensor: TensorSpec, index: Index) -> torch.Tensor:
        """``tensor``'s values at ``index`` (a non-expert tensor)."""

    def read_expert(self, tensor: TensorSpec, expert: int, index: Index) -> torch.Tensor:
        """Routed expert ``expert``'s matrix of the stacked ``tensor``, at ``index`` (over the
        matrix's own dimensions)."""


class InitialValues:
    """The spec's initial values (``factory.graph.init``) for a run's ``seed``."""

    def __init__(self, spec: ModelSpec, seed: int) -> None:
        self.seed, self.std, self.layers = seed, spec.model.init.std, spec.layer_count()

    def read(self, tensor: TensorSpec, index: Index) -> torch.Tensor:
        return take(initial_value(tensor, self.seed, self.std, self.layers), index)

    def read_expert(self, tensor: TensorSpec, expert: int, index: Index) -> torch.Tensor:
        value = expert_initial_value(tensor, self.seed, self.std, self.layers, expert)
        return take(value, index)


def _on_dim_zero(placement: Placement, dim: int) -> Placement:
    """``placement`` as it acts on one dimension ``dim`` of a tensor, moved to dimension 0."""
    if isinstance(placement, _StridedShard) and placement.dim == dim:
        return _StridedShard(0, split_factor=placement.split_factor)
    if isinstance(placement, Shard) and placement.dim == dim:
        return Shard(0)
    return Replicate()


def local_index(param: torch.Tensor, module: nn.Module, name: str) -> Index:
    """The canonical indices, dimension by dimension, of the part of ``module.name`` this rank
    holds (``param``, a DTensor or a plain tensor held whole)."""
    if not isinstance(param, DTensor):
        return [None] * param.ndim
    index: Index = []
    for dim, size in enumerate(param.shape):
        placements = [_on_dim_zero(p, dim) for p in param.placements]
        if all(isinstance(p, Replicate) for p in placements):
            index.append(None)
            continue
        probe = torch.arange(size, device=param.to_local().device)
        index.append(distribute_tensor(probe, param.device_mesh, placements, src_data_rank=None)
                     .to_local())  # fmt: skip
    order = canonical_order(module, name)
    if order is not None:
        dim, canonical = order
        held = index[dim]
        index[dim] = canonical if held is None else canonical[held.cpu()]
    return index


def _holder(model: nn.Module, tensor: TensorSpec) -> tuple[nn.Module, str] | None:
    try:
        module = model.get_submodule(tensor.module)
    except AttributeError:
        return None  # a tensor of another pipeline stage
    return module, tensor.name.rpartition(".")[2]


@torch.no_grad()
def _fill(local: torch.Tensor, tensor: TensorSpec, index: Index, source: ValueSource) -> None:
    if tensor.expert_dim is None:
        local.copy_(source.read(tensor, index))
        return
    assert tensor.expert_dim == 0, "stacked experts lead their tensors"
    experts = range(tensor.shape[0]) if index[0] is None else index[0].tolist()
    for row, expert in enumerate(experts):
        local[row].copy_(source.read_expert(tensor, expert, index[1:]))


def materialize(
    model: nn.Module, spec: ModelSpec, source: ValueSource, device: torch.device | str
) -> None:
    """Give every tensor of the laid-out ``model`` (a whole model or a pipeline stage of one)
    its storage on ``device`` and this rank's part of its value from ``source``."""
    model.to_empty(device=device)
    for tensor in spec.tensors():
        holder = _holder(model, tensor)
        if holder is None or tensor.tied_to is not None:
            continue
        module, name = holder
        param = getattr(module, name)
        local = param.to_local() if isinstance(param, DTensor) else param
        _fill(local, tensor, local_index(param, module, name), source)
