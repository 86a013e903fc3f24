"""Expert and expert-tensor parallelism of one MoE layer (MoE parallel folding).

The routed experts see the expert grid ``(pp, edp, ep, etp)`` of
``factory.distributed.mesh``. :func:`shard_experts` (called for every MoE layer by
``factory.distributed.parallelize.apply_expert_parallel``) makes every routed-expert
parameter a DTensor over the 2-D ``(ep, etp)`` mesh, split as the model spec says:
``Shard(0)`` over EP (EP rank ``j`` holds experts ``j*L .. (j+1)*L - 1`` with
``L = E/EP``) and the spec's tensor-parallel split over ETP (``up_proj`` and
``gate_proj`` by columns, ``Shard(1)``, ``down_proj`` by rows, ``Shard(2)``, each
projection on its own, so a rank's gate and up columns pair up). It installs an
:class:`AllToAllDispatcher` as the layer's ``MoE.dispatcher``: Megatron-Core's
``MoEAlltoAllTokenDispatcher`` with its ``TEGroupedMLP``, over our own
``route_tokens`` and ``RoutedExperts``.

One MoE layer's forward on one rank:

1. Routing, aux loss, capacity dropping and the ``[E]`` load vector run on this
   rank's tokens alone, exactly as without EP (``MoE.forward``). The capacity
   is therefore per rank, as in Megatron.
2. Counts: the kept pairs per (destination EP rank, its local expert) go through
   one ``all_to_all_single`` of ``E`` integers over EP, then what each rank
   receives (``EP*L`` integers) is all-gathered over ETP, so every rank knows
   how many rows each ETP peer will bring for each local expert; all split sizes
   are read to the host together. That is the layer's one host sync, and it is
   inherent to the exchange: ``all_to_all_single`` takes its split sizes as
   host lists, and the receive buffer's size is the peers' data (Megatron-Core's
   ``MoEAlltoAllTokenDispatcher`` syncs there too). Everything else (the routing,
   the send buffer, the local experts' sort and their ``_grouped_mm`` path, the
   combine) reads nothing back, so the EP block is not compiled
   (``MoE.sync_free``) but costs one sync per layer, not one per step of it.
3. Dispatch over EP: ``route_tokens`` already sorted the pairs by expert, and
   EP rank ``j``'s experts are contiguous, so the kept pairs in sorted order are
   grouped by destination: one ``index_select`` builds the send buffer and one
   autograd-aware all-to-all with uneven splits moves it to the EP peers with
   the same ETP rank.
4. All-gather over ETP (uneven): each ETP rank sends its received rows to every
   ETP peer (an all-to-all of its rows repeated once per peer; gloo has no
   uneven all-gather), so every ETP rank of an expert holds the union of its
   peers' rows, ordered (ETP rank, EP source, local expert, token).
5. Experts: those rows, as k=1 routings over the L local experts, run through
   the layer's ``RoutedExperts`` (``grouped_mlp`` and its paths on the local
   weight shards, with the layer's ``linear`` hook), called as a module so FSDP's
   hooks gather the expert-data-parallel shards first. With ETP the column ``up``
   (and ``gate``), the activation and the row ``down`` make this rank's share of
   the ffn, a partial sum of each row's output; the GEMMs do no communication.
6. Reduce-scatter over ETP (uneven): each peer's block of partial sums goes back
   to it (an all-to-all) and each rank adds the ``ETP`` blocks it receives, in
   rank order: its own rows' outputs, summed over the whole ffn.
7. Combine: the reverse all-to-all over EP returns each output to its pair's
   rank in send order; dropped pairs count 0; the weighted sum over the k slots
   runs in fp32 exactly as ``grouped_mlp`` forms it.

Backward: an all-to-all's gradient is the reverse all-to-all, so the all-gather
of step 4 differentiates to a reduce-scatter (the repeated copies' gradients
add up) and the reduce-scatter of step 6 to an all-gather. Each rank's expert
gradient is exact for its shard: it sums over every row its experts saw from
every EP and ETP peer; the dense parameters' gradients stay local (reducing
those, and the experts' over the expert-data-parallel group, is FSDP's or DDP's
job). Every rank of the expert group runs the same layers in the same order
(the collectives pair up), including ranks that send or receive nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from factory.kernels.moe_dispatch import Dispatch, combine, route_tokens
from factory.layers.moe.module import RoutedExperts
from factory.spec.tensors import TensorSpec

__all__ = [
    "AllToAllDispatcher",
    "gather_rows",
    "reduce_scatter_rows",
    "shard_experts",
]


def gather_rows(rows: torch.Tensor, peer_rows: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    """All-gather-v over ``group``: every peer's ``rows`` (``peer_rows[j]`` of them from peer
    ``j``), concatenated in rank order. An all-to-all sending this rank's rows to each peer,
    so its gradient is a reduce-scatter-v: the reverse all-to-all, then the sum over the
    copies."""
    copies = len(peer_rows)
    return all_to_all_single_autograd(
        rows.repeat(copies, 1), peer_rows, [rows.shape[0]] * copies, group
    )


def reduce_scatter_rows(
    rows: torch.Tensor, peer_rows: list[int], rank: int, group: dist.ProcessGroup
) -> torch.Tensor:
    """Reduce-scatter-v over ``group``: ``rows`` holds a partial sum for every peer's rows
    (``peer_rows[j]`` for peer ``j``, in rank order); returns this rank's ``peer_rows[rank]``
    rows summed over the peers, in rank order. Its gradient is an all-gather-v."""
    copies, own = len(peer_rows), peer_rows[rank]
    received = all_to_all_single_autograd(rows, [own] * copies, peer_rows, group)
    return received.reshape(copies, own, rows.shape[1]).sum(0)


class _Splits(NamedTuple):
    """Row counts of one layer's exchange, as seen by this rank."""

    send: list[int]
    """Rows sent to each EP rank."""
    receive: list[int]
    """Rows received from each EP rank."""
    peers: list[int]
    """Rows each ETP peer (this rank included) brings to the gathered block."""
    per_expert: torch.Tensor
    """[ETP * EP * L] rows of the gathered block per (ETP peer, EP source, local expert)."""


class AllToAllDispatcher:
    """``MoE.dispatcher`` for one expert group: exchanges the kept (token, slot) pairs with the
    ranks holding their experts and combines the returned outputs (module docstring)."""

    def __init__(self, expert_mesh: DeviceMesh, num_experts: int) -> None:
        self.ep_group, self.etp_group = expert_mesh.get_group("ep"), expert_mesh.get_group("etp")
        self.ep_size, self.etp_size = expert_mesh["ep"].size(), expert_mesh["etp"].size()
        self.etp_rank = expert_mesh.get_local_rank("etp")
        self.num_experts = num_experts
        self.num_local = num_experts // self.ep_size

    def __call__(
        self,
        experts: RoutedExperts,
        x: torch.Tensor,
        dispatch: Dispatch,
        weights: torch.Tensor,
        capacity: int | None,
    ) -> torch.Tensor:
        if dispatch.num_experts != self.num_experts:
            raise ValueError(
                f"dispatch over {dispatch.num_experts} experts, dispatcher built for "
                f"{self.num_experts}"
            )
        num_tokens, d_in = x.shape
        kept_per_expert = dispatch.tokens_per_expert
        if capacity is not None:
            kept_per_expert = kept_per_expert.clamp(max=capacity)
        splits = self._exchange_counts(kept_per_expert)
        # Sorted positions of the pairs sent (all, or each expert's first `capacity`): the
        # kept ones in sorted order lead a stable argsort of "dropped", and their number is
        # already on the host, so no nonzero() with its own sync.
        sent = None
        if capacity is not None:
            dropped = (dispatch.rank_in_expert >= capacity).to(torch.int8)
            sent = torch.argsort(dropped, stable=True)[: sum(splits.send)]
        sources = dispatch.token_index if sent is None else dispatch.token_index[sent]

        rows = x.index_select(0, sources)
        if self.ep_size > 1:
            rows = all_to_all_single_autograd(rows, splits.receive, splits.send, self.ep_group)
        if self.etp_size > 1:
            rows = gather_rows(rows, splits.peers, self.etp_group)
        local_expert = torch.arange(self.num_local, device=x.device)
        local_expert = local_expert.repeat(self.etp_size * self.ep_size)
        # The row count is on the host already: repeat_interleave need not read it back.
        local_index = local_expert.repeat_interleave(splits.per_expert, output_size=rows.shape[0])
        local_dispatch = route_tokens(local_index[:, None], self.num_local, check=False)
        # Through the module, not grouped_mlp on its weights: FSDP's hooks gather them.
        out = experts(rows, local_dispatch, None)
        if self.etp_size > 1:
            out = reduce_scatter_rows(out, splits.peers, self.etp_rank, self.etp_group)
        if self.ep_size > 1:
            out = all_to_all_single_autograd(out, splits.send, splits.receive, self.ep_group)

        pairs = num_tokens * dispatch.top_k
        if sent is not None:  # dropped pairs were not sent: they contribute 0
            out = out.new_zeros(pairs, d_in).index_copy(0, sent, out)
        # The same fp32 (fp64 for fp64) weighted sum over slots as grouped_mlp's.
        return combine(out.index_select(0, dispatch.inverse_order), dispatch, weights, x.dtype)

    def _exchange_counts(self, kept_per_expert: torch.Tensor) -> _Splits:
        """Step 2 of the module docstring: the row counts of every exchange of this layer."""
        received = kept_per_expert.contiguous()
        if self.ep_size > 1:
            # received[s * L + l]: pairs EP rank s sends to this rank's local expert l.
            received = torch.empty_like(received)
            dist.all_to_all_single(received, kept_per_expert.contiguous(), group=self.ep_group)
        gathered = received
        if self.etp_size > 1:
            gathered = received.new_empty(self.etp_size * received.numel())
            dist.all_gather_single(gathered, received, group=self.etp_group)
        by_rank = (self.ep_size, self.num_local)
        sizes = torch.cat([
            kept_per_expert.view(by_rank).sum(1),
            received.view(by_rank).sum(1),
            gathered.view(self.etp_size, -1).sum(1),
        ]).tolist()  # fmt: skip
        ep = self.ep_size
        return _Splits(sizes[:ep], sizes[ep : 2 * ep], sizes[2 * ep :], gathered)


def shard_experts(
    moe: nn.Module, expert_mesh: DeviceMesh, tensors: Mapping[str, TensorSpec]
) -> None:
    """Keep this rank's block of ``moe``'s routed experts (each a DTensor of the whole tensor
    over the 2-D ``(ep, etp)`` ``expert_mesh``: ``Shard(expert_dim)`` over EP, the spec's
    tensor-parallel split over ETP) and install the :class:`AllToAllDispatcher` that brings
    it its tokens. ``tensors`` are the routed-expert tensors by their names under ``moe``.

    Expects the initialised full layer, identical across the expert group: each rank keeps
    its own block with no communication.
    """
    for name, spec in tensors.items():
        if spec.expert_dim is None or spec.tp is None:
            raise ValueError(f"{spec.name}: a routed-expert tensor needs its expert dimension "
                             "and its tensor-parallel split in the spec")  # fmt: skip
        owner_name, _, attr = name.rpartition(".")
        owner = moe.get_submodule(owner_name)
        param = owner._parameters[attr]
        placements = (Shard(spec.expert_dim), Shard(spec.tp.dim))
        block = param.detach()
        for dim_name, placement in zip(("ep", "etp"), placements, strict=True):
            ranks, rank = expert_mesh[dim_name].size(), expert_mesh.get_local_rank(dim_name)
            block = block.chunk(ranks, dim=placement.dim)[rank]
        # A contiguous copy: a view would keep the full tensor alive on every rank.
        block = block.clone(memory_format=torch.contiguous_format)
        sharded = DTensor.from_local(
            block, expert_mesh, placements, run_check=False, shape=param.shape,
            stride=param.stride(),
        )  # fmt: skip
        owner.register_parameter(attr, nn.Parameter(sharded, requires_grad=param.requires_grad))
    moe.dispatcher = AllToAllDispatcher(expert_mesh, moe.cfg.num_experts)
