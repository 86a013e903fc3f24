"""Expert parallelism of one MoE layer: each EP rank holds E/EP experts; tokens travel to them.

:func:`shard_experts` (called for every MoE layer by
``factory.distributed.parallelize.apply_expert_parallel``) shards every routed-expert
parameter along the expert dimension over the EP mesh (a ``Shard(0)`` DTensor: EP rank ``j`` holds
experts ``j*L .. (j+1)*L - 1`` with ``L = E/EP``) and installs an
:class:`AllToAllDispatcher` as the layer's ``MoE.dispatcher``. This is the
all-to-all token dispatcher of Megatron-Core and torchtitan, over our own
``route_tokens``/``grouped_mlp``.

One MoE layer's forward on one rank:

1. Routing, aux loss, capacity dropping and the ``[E]`` load vector run on this
   rank's tokens alone, exactly as without EP (``MoE.forward``). The capacity
   is therefore per rank, as in Megatron.
2. Counts: the kept pairs per (destination rank, its local expert) go through
   one ``all_to_all_single`` of ``E`` integers, so every rank learns how many
   pairs each source sends to each of its local experts; the split sizes are
   read to the host together (one sync).
3. Dispatch: ``route_tokens`` already sorted the pairs by expert, and rank
   ``j``'s experts are contiguous, so the kept pairs in sorted order are grouped
   by destination: one ``index_select`` builds the send buffer and one
   autograd-aware all-to-all with uneven splits moves it.
4. Experts: the received rows are ordered (source rank, local expert, token);
   as k=1 routings over the L local experts they run through the layer's
   ``RoutedExperts`` (``grouped_mlp`` on the local weight shards, with the
   layer's ``linear`` hook), called as a module so FSDP's hooks gather the
   expert-data-parallel shards first.
5. Combine: the reverse all-to-all returns each output to its pair's rank in
   send order; dropped pairs count 0; the weighted sum over the k slots runs in
   fp32 exactly as ``grouped_mlp`` forms it.

Backward: an all-to-all's gradient is the reverse all-to-all, so each rank's
expert gradient sums over the tokens routed to its experts from every EP rank,
while the dense parameters' gradients stay local (reducing those over the data
ranks is FSDP's or DDP's job, as without EP). Every rank of the EP group runs
the same layers in the same order (the collectives pair up), including ranks
that send or receive nothing.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from factory.kernels.moe_dispatch import Dispatch, route_tokens
from factory.layers.moe.module import RoutedExperts

__all__ = ["AllToAllDispatcher", "local_experts", "shard_experts"]


def local_experts(ep_size: int, ep_rank: int, num_experts: int) -> range:
    """The global indices of the experts EP rank ``ep_rank`` holds."""
    per_rank = num_experts // ep_size
    return range(ep_rank * per_rank, (ep_rank + 1) * per_rank)


class AllToAllDispatcher:
    """``MoE.dispatcher`` for one EP group: exchanges the kept (token, slot) pairs with the
    ranks holding their experts and combines the returned outputs (module docstring)."""

    def __init__(self, ep_mesh: DeviceMesh, num_experts: int) -> None:
        self.group = ep_mesh.get_group()
        self.ep_size = ep_mesh.size()
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
        # Sorted positions of the pairs sent (all, or each expert's first `capacity`).
        if capacity is None:
            sent, kept_per_expert = None, dispatch.tokens_per_expert
        else:
            sent = (dispatch.rank_in_expert < capacity).nonzero().squeeze(1)
            kept_per_expert = dispatch.tokens_per_expert.clamp(max=capacity)
        sources = dispatch.token_index if sent is None else dispatch.token_index[sent]

        # received[s * L + l]: pairs source rank s sends to this rank's local expert l.
        received = torch.empty_like(kept_per_expert)
        dist.all_to_all_single(received, kept_per_expert.contiguous(), group=self.group)
        shape = (self.ep_size, self.num_local)
        splits = torch.stack([kept_per_expert.view(shape).sum(1), received.view(shape).sum(1)])
        send_splits, recv_splits = splits.tolist()

        inbound = all_to_all_single_autograd(
            x.index_select(0, sources), recv_splits, send_splits, self.group
        )
        local_expert = torch.arange(self.num_local, device=x.device).repeat(self.ep_size)
        local_dispatch = route_tokens(
            local_expert.repeat_interleave(received)[:, None], self.num_local
        )
        # Through the module, not grouped_mlp on its weights: FSDP's hooks gather them.
        out = experts(inbound, local_dispatch, None)
        returned = all_to_all_single_autograd(out, send_splits, recv_splits, self.group)

        pairs = num_tokens * dispatch.top_k
        if sent is not None:  # dropped pairs were not sent: they contribute 0
            returned = returned.new_zeros(pairs, d_in).index_copy(0, sent, returned)
        pair_out = returned.index_select(0, dispatch.inverse_order)
        # The same fp32 (fp64 for fp64) weighted sum over slots as grouped_mlp's.
        acc = torch.float64 if x.dtype == torch.float64 else torch.float32
        pair_out = pair_out.to(acc).reshape(num_tokens, dispatch.top_k, d_in)
        return (pair_out * weights.to(acc)[..., None]).sum(dim=1).to(x.dtype)


def shard_experts(moe: nn.Module, ep_mesh: DeviceMesh) -> None:
    """Keep this EP rank's slice of ``moe``'s routed experts (a ``Shard(0)`` DTensor of the
    whole stack) and install the :class:`AllToAllDispatcher` that brings it its tokens.

    Expects the initialised full layer, identical across the EP group: each rank keeps
    its own slice with no communication.
    """
    ep_size, ep_rank = ep_mesh.size(), ep_mesh.get_local_rank()
    for attr, param in list(moe.experts.named_parameters(recurse=False)):
        # clone: a view would keep the full [E, ...] storage alive on every rank.
        shard = param.detach().chunk(ep_size, dim=0)[ep_rank].clone()
        sharded = DTensor.from_local(
            shard, ep_mesh, [Shard(0)], run_check=False, shape=param.shape, stride=param.stride()
        )
        setattr(moe.experts, attr, nn.Parameter(sharded, requires_grad=param.requires_grad))
    moe.dispatcher = AllToAllDispatcher(ep_mesh, moe.cfg.num_experts)
