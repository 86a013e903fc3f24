"""What the trainer asks of the other processes, answered by one process or over torch.distributed.

The trainer, the step and the checkpointer talk to the other ranks only through
:class:`Ranks`: sums over the data-parallel group (token counts, losses), sums
over the ranks that route distinct tokens (expert loads, for the expert-bias
step and MaxVio), the global gradient norm, and agreement on decisions (rank 0's, or the
highest of every rank's, as for a stop signal that reached only some ranks). Every
rank asks the same questions in the same order, so the collectives match.

:func:`joined_ranks` gives a training its :class:`Ranks`: a run on one process
is world size 1 of the same code (:class:`SingleProcess` answers every question
itself, with no process group); on several it joins the default process group
(or uses the caller's) and answers over the layout's meshes
(:class:`DistributedRanks`). Groups, from ``factory.distributed.mesh``:

* data: the dense grid's ``dp`` dimension, over which the global batch is split
  (the micro-batches' target-token counts are summed over it);
* tokens: ``dp`` and ``cp`` together (``meshes.tokens``), the ranks that hold
  distinct tokens of the step: losses, token counts, per-layer statistics and
  the routing loads are summed over it (with sequence parallelism each TP rank
  routes its own part of the sequence, and tensor parallelism already sums the
  loads over the TP group in the forward pass, ``factory.distributed.tensor_parallel``,
  so every TP rank moves its expert biases alike);
* pipeline: the ``pp`` dimension; stages hold different layers, so per-layer
  statistics are gathered over it, and gradient norms summed.

Collectives time out after ``FACTORY_COLLECTIVE_TIMEOUT_S`` seconds (default
600): a rank that dies makes the others fail at their next collective (gloo
and NCCL see the closed connection) instead of waiting for ever, and the
launcher then names the rank that failed first.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import warnings
from collections.abc import Iterable, Iterator
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from factory.distributed.mesh import Meshes, build_meshes
from factory.planner.layout import Layout
from factory.rank_process import mark_rank_process

__all__ = [
    "DistributedRanks",
    "Ranks",
    "SingleProcess",
    "collective_timeout",
    "is_transport_failure",
    "joined_process_group",
    "joined_ranks",
]


class Ranks(Protocol):
    rank: int
    """Global rank of this process (0 on one process)."""
    world_size: int
    data_rank: int
    """Index of this rank's data-parallel replica: which micro-batches it reads."""
    data_size: int
    """Data-parallel replicas: the global batch is split among them."""
    context_size: int
    """Context-parallel ranks: each holds 1/context_size of every sequence."""
    device: torch.device
    """Where this rank's share of the model lives."""
    meshes: Meshes | None
    """The layout's device meshes (None on one process: nothing to lay out)."""

    @property
    def is_main(self) -> bool:
        """Rank 0: writes meta.json, metrics.jsonl and the progress display."""

    def sum_over_data(self, value: torch.Tensor) -> torch.Tensor:
        """``value`` summed over the data-parallel replicas (micro-batch target counts)."""

    def sum_over_tokens(self, value: torch.Tensor) -> torch.Tensor:
        """``value`` summed over the ranks holding distinct tokens (losses, token counts)."""

    def mean_over_tokens(self, values: dict[str, float]) -> dict[str, float]:
        """Per-layer statistics averaged over the ranks holding distinct tokens, and known for
        every layer on every rank."""

    def sum_over_routing(self, loads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Per-layer expert loads summed over every rank that routed distinct tokens, and
        known for every layer on every rank (pipeline stages hold different layers)."""

    def grad_norm(self, params: Iterable[nn.Parameter]) -> torch.Tensor:
        """The L2 norm of all gradients of the whole model, whatever holds which shard."""

    def agree(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank (decisions every rank must take together)."""

    def highest(self, value: int) -> int:
        """The largest of every rank's ``value`` on every rank (a stop signal any rank
        received, a checkpoint any rank could not read)."""

    def barrier(self) -> None: ...


class SingleProcess:
    """One process holds everything: every question answers itself."""

    rank = 0
    world_size = 1
    data_rank = 0
    data_size = 1
    context_size = 1
    meshes = None

    def __init__(self, device: torch.device | str | None = None) -> None:
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))

    @property
    def is_main(self) -> bool:
        return True

    def sum_over_data(self, value: torch.Tensor) -> torch.Tensor:
        return value

    def sum_over_tokens(self, value: torch.Tensor) -> torch.Tensor:
        return value

    def mean_over_tokens(self, values: dict[str, float]) -> dict[str, float]:
        return values

    def sum_over_routing(self, loads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return loads

    def grad_norm(self, params: Iterable[nn.Parameter]) -> torch.Tensor:
        grads = [p.grad for p in params if p.grad is not None]
        return nn.utils.get_total_norm(grads) if grads else torch.zeros(())

    def agree(self, value: Any) -> Any:
        return value

    def highest(self, value: int) -> int:
        return value

    def barrier(self) -> None:
        return None


def _replicas(grad: torch.Tensor, stage_ranks: int) -> int:
    """How many ranks hold this very shard: the mesh dims it is replicated over (a plain
    tensor is held whole by every rank of its stage)."""
    if not isinstance(grad, DTensor):
        return stage_ranks
    held = 1
    for size, placement in zip(grad.device_mesh.shape, grad.placements, strict=True):
        if isinstance(placement, Replicate):
            held *= size
    return held


class DistributedRanks:
    """:class:`Ranks` over the process group of ``meshes``."""

    def __init__(self, meshes: Meshes) -> None:
        self.meshes = meshes
        cuda = meshes.device_type == "cuda"
        # The model's device; NCCL reduces device tensors, gloo host tensors.
        self.device = (
            torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        )
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.data_rank = meshes.coordinate("dp")
        self.data_size = meshes.layout.dp
        self.context_size = meshes.layout.cp
        self._data = meshes.dense["dp"].get_group()
        self._tokens = meshes.tokens.get_group()
        self._pipeline = meshes.dense["pp"].get_group()
        layout = meshes.layout
        self._stage_ranks = layout.dp * layout.cp * layout.tp

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def sum_over_data(self, value: torch.Tensor) -> torch.Tensor:
        return self._sum(value, self._data)

    def sum_over_tokens(self, value: torch.Tensor) -> torch.Tensor:
        return self._sum(value, self._tokens)

    def _sum(self, value: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        total = value.detach().to(self.device, copy=True)
        dist.all_reduce(total, group=group)
        return total.to(value.device)

    def _gather_stages(self, values: dict[str, Any]) -> dict[str, Any]:
        """Every stage's per-layer values on every rank (stages hold different layers)."""
        if self.meshes.layout.pp == 1:
            return values
        gathered: list[Any] = [None] * self.meshes.layout.pp
        dist.all_gather_object(gathered, values, self._pipeline)
        merged = {n: v for part in gathered for n, v in part.items()}
        return {n: merged[n] for n in sorted(merged)}

    def mean_over_tokens(self, values: dict[str, float]) -> dict[str, float]:
        names = sorted(values)
        if names:
            stacked = torch.tensor([values[n] for n in names], dtype=torch.float64)
            stacked = self.sum_over_tokens(stacked) / (self.data_size * self.context_size)
            values = dict(zip(names, stacked.tolist(), strict=True))
        return self._gather_stages(values)

    def sum_over_routing(self, loads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        names = sorted(loads)
        if names:
            stacked = torch.stack([loads[n].to(self.device, torch.int64) for n in names])
            dist.all_reduce(stacked, group=self._tokens)
            loads = dict(zip(names, stacked.unbind(0), strict=True))
        if self.meshes.layout.pp == 1:
            return {n: t.cpu() for n, t in loads.items()}
        lists = self._gather_stages({n: t.tolist() for n, t in loads.items()})
        return {n: torch.tensor(v) for n, v in lists.items()}

    def grad_norm(self, params: Iterable[nn.Parameter]) -> torch.Tensor:
        """Sum of squares of every local shard, divided by how many ranks hold that shard,
        summed over all ranks: each element of the model counted exactly once."""
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for param in params:
            grad = param.grad
            if grad is None:
                continue
            local = grad.to_local() if isinstance(grad, DTensor) else grad
            squares = local.detach().double().square().sum().to(self.device)
            total += squares / _replicas(grad, self._stage_ranks)
        dist.all_reduce(total)
        return total.sqrt().float()

    def agree(self, value: Any) -> Any:
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def highest(self, value: int) -> int:
        box = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(box, op=dist.ReduceOp.MAX)
        return int(box.item())

    def barrier(self) -> None:
        dist.barrier()


def collective_timeout() -> datetime.timedelta:
    return datetime.timedelta(seconds=float(os.environ.get("FACTORY_COLLECTIVE_TIMEOUT_S", 600)))


@contextlib.contextmanager
def joined_process_group(world_size: int) -> Iterator[None]:
    """This process in the default process group (NCCL on CUDA, gloo on CPU) for the block,
    when ``world_size`` > 1; a caller may have made it already, and then keeps it.

    Several runs in one launch (a program's stages) share one group: torch names a group
    made again after one was destroyed as it named the first, so the new group would meet
    the old one's keys in the launcher's store and wait for ranks that never come.
    """
    if world_size == 1:
        yield
        return
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("nccl" if cuda else "gloo", timeout=collective_timeout())
        mark_rank_process()
    try:
        yield
    finally:
        if owned:
            dist.destroy_process_group()


@contextlib.contextmanager
def joined_ranks(layout: Layout) -> Iterator[Ranks]:
    """This process's :class:`Ranks` in ``layout``, for the length of a run.

    World size 1 answers itself. Otherwise the process joins the default process group
    (:func:`joined_process_group`) and builds the layout's meshes.
    """
    if layout.world_size == 1:
        yield SingleProcess()
        return
    # The step's routing statistics are detached views; nothing edits them in place.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    with joined_process_group(layout.world_size):
        yield DistributedRanks(build_meshes(layout, "cuda" if torch.cuda.is_available() else "cpu"))


def is_transport_failure(exc: BaseException) -> bool:
    """A failure of the other end (gloo's TCP pairs, NCCL, a collective's timeout), not a bug
    on this rank."""
    if isinstance(exc, dist.DistError):
        return True
    text = str(exc)
    return any(sign in text for sign in ("gloo", "NCCL", "Connection reset", "Connection closed"))
