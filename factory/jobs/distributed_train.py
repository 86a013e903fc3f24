"""The distributed half of ``factory.train``: one rank of a ``torchrun`` launch.

Every rank runs the same job (``factory.jobs.train``) with its own share of
the work:

1. rank 0 builds the data recipe's shards (the others wait at a barrier; the
   run folder must be on storage every rank sees);
2. every rank compiles the same model from the same seed, then shards it over
   the layout's meshes (``factory.distributed``);
3. every rank trains on its data-parallel share (``factory.runtime.loop`` with
   :class:`~factory.distributed.ranks.DistributedRanks`); rank 0 shows progress
   and writes ``metrics.jsonl``, each other rank ``ranks/rank_NNNNN.jsonl``;
   checkpoints are DCP, written by all ranks together;
4. rank 0 reads the final checkpoint back into a one-process model (DCP
   reshards) and writes ``train.json``, ``model/`` and the report, as a
   one-process run does.

Collectives time out after ``FACTORY_COLLECTIVE_TIMEOUT_S`` seconds (default
600): a rank that dies makes the others fail at their next collective (gloo
and NCCL see the closed connection) instead of waiting for ever, and torchrun
then names the rank that failed first.
"""

from __future__ import annotations

import datetime
import os
import warnings
from typing import TYPE_CHECKING

import factory

if TYPE_CHECKING:
    from factory.compilation import Compiled
    from factory.jobs.train import _Job
    from factory.runtime.loop import TrainResult as LoopResult

__all__ = ["RankLost", "collective_timeout", "run_rank"]


class RankLost(RuntimeError):
    """A collective failed mid-run: another rank died or stopped answering."""


def collective_timeout() -> datetime.timedelta:
    return datetime.timedelta(seconds=float(os.environ.get("FACTORY_COLLECTIVE_TIMEOUT_S", 600)))


def run_rank(job: _Job) -> tuple[Compiled, LoopResult, str]:
    """Train this rank's share of ``job``; returns (rank 0's one-process copy of the trained
    model, the loop's result, the device), the copy being built on rank 0 only."""
    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    # The step's routing statistics are detached views; nothing edits them in place.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    owned = not dist.is_initialized()  # a caller may have made the process group already
    if owned:
        dist.init_process_group("nccl" if cuda else "gloo", timeout=collective_timeout())
    try:
        return _train(job, "cuda" if cuda else "cpu")
    except (dist.DistError, RuntimeError) as exc:
        if not _is_transport_failure(exc):
            raise
        first_line = str(exc).strip().splitlines()[0][:300]
        raise RankLost(
            f"rank {dist.get_rank()}: a collective failed, so another rank has died or stopped "
            f"answering ({first_line}); the launcher names the rank that failed first, and "
            "rerunning the same command resumes from the last checkpoint"
        ) from exc
    finally:
        if owned:
            dist.destroy_process_group()


def _is_transport_failure(exc: BaseException) -> bool:
    """A failure of the other end (gloo's TCP pairs, NCCL, a collective's timeout), not a bug
    on this rank."""
    import torch.distributed as dist

    if isinstance(exc, dist.DistError):
        return True
    text = str(exc)
    return any(sign in text for sign in ("gloo", "NCCL", "Connection reset", "Connection closed"))


def _train(job: _Job, device_type: str) -> tuple[Compiled, LoopResult, str]:
    import torch.distributed as dist

    from factory.distributed.mesh import build_meshes
    from factory.distributed.parallelize import parallelize_compiled
    from factory.distributed.ranks import DistributedRanks
    from factory.planner.layout import resolve_layout

    main = dist.get_rank() == 0
    job.out.mkdir(parents=True, exist_ok=True)
    shards = job.data if job.data is not None else job.out / "data"
    if job.data is None and main:
        job._build_data(shards)
    dist.barrier()
    meshes = build_meshes(resolve_layout(job.bp), device_type)
    ranks = DistributedRanks(meshes)
    device = f"cuda:{os.environ.get('LOCAL_RANK', '0')}" if device_type == "cuda" else "cpu"
    compiled = factory.compile(job.bp, device=device, seed=job.seed, precision=job.precision)
    parallelize_compiled(compiled, meshes, device)
    history = job._train_loop(compiled, shards, ranks)
    dist.barrier()
    single = _read_back(job, compiled) if main else compiled
    dist.barrier()
    return single, history, device_type


def _read_back(job: _Job, compiled: Compiled) -> Compiled:
    """A one-process copy of the trained model, read from the run's last checkpoint."""
    import torch.distributed.checkpoint as dcp

    from factory.runtime.checkpoint import complete_checkpoints, single_process_quiet

    single = factory.compile(job.bp, device="cpu", seed=job.seed, precision=job.precision)
    found = complete_checkpoints(job.out / "checkpoints")
    if found:
        state = {"model": single.model.state_dict()}
        with single_process_quiet():
            dcp.load(state, checkpoint_id=str(found[-1][1]), no_dist=True)
    return single
