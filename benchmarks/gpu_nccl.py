"""Section 7: factory's distributed code paths on one NCCL rank.

This process joins a one-rank NCCL process group (gloo in a dry run) and runs what a
``torchrun`` launch of ``factory train`` runs on each rank, with the 1B blueprint's CPU
proxy laid out over world size 1: the layout's device meshes, ``lay_out`` (FSDP2 around
the blocks and the root, BF16 compute on CUDA), factory's ``MasterOptimizer``, three
training steps through ``forward_backward`` with :class:`DistributedRanks` (its
collectives: token counts, routing loads, the global gradient norm), then a DCP
checkpoint written by ``Checkpointer`` and read back by ``read_checkpoint`` into
parameters zeroed first, which must then equal what was saved. Reported: the step times,
the losses, whether parameters became DTensors, and the checkpoint round trip.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.gpu_common import SectionContext, table, timed

TITLE = "Distributed code paths on one NCCL rank"
BUDGET_S = 30
"""On an H100: the process group, the proxy's FSDP2 wrap, three steps and a DCP round trip."""

STEPS = 3


def _join(ctx: SectionContext) -> str:
    from factory.distributed.local import free_port

    backend = "gloo" if ctx.device.type == "cpu" else "nccl"
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0")  # fmt: skip
    if backend == "nccl":
        torch.cuda.set_device(0)
    dist.init_process_group(backend, rank=0, world_size=1)
    return backend


def _laid_out(ctx: SectionContext) -> tuple[Any, Any, Any]:
    """The proxy compiled on the device and laid out over a one-rank layout."""
    import factory
    from benchmarks.gpu_train import load
    from factory.distributed.mesh import build_meshes
    from factory.planner.layout import resolve_layout
    from factory.runtime.placement import lay_out
    from factory.runtime.ranks import DistributedRanks

    blueprint = load(True)  # the CPU proxy: this section checks code paths, not speed
    ranks = DistributedRanks(build_meshes(resolve_layout(blueprint), ctx.device.type))
    compiled = factory.compile(blueprint, device=ctx.device, seed=0, precision="off")
    lay_out(compiled, ranks)
    return blueprint, compiled, ranks


def _train(ctx: SectionContext, blueprint: Any, compiled: Any, ranks: Any) -> None:
    from benchmarks.distributed import _step
    from factory.graph.loss import mtp_loss_scale
    from factory.runtime.batches import MicroBatch
    from factory.runtime.optimizer import MasterOptimizer

    optimizer = MasterOptimizer(compiled.model, blueprint.training.optimizer)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, blueprint.model.vocab_size, (2, 128), generator=gen).to(ctx.device)
    micro = [MicroBatch(ids, torch.ones_like(ids, dtype=torch.bool))]
    mtp = mtp_loss_scale(blueprint.model)
    losses, seconds = [], []
    for _ in range(STEPS):
        seconds.append(timed(lambda: _step(compiled, ranks, micro, optimizer, mtp), ctx.device))
        with torch.no_grad():
            from factory.graph.loss import language_model_loss

            losses.append(float(language_model_loss(compiled.model(ids), ids).lm))
    ctx.record("step_s", seconds)
    ctx.record("lm_loss_after_each_step", losses)
    if not all(torch.isfinite(torch.tensor(losses))):
        ctx.fail(f"non-finite loss: {losses}")


def _round_trip(ctx: SectionContext, model: torch.nn.Module, ranks: Any) -> None:
    """DCP save, zero the parameters, load: every tensor must come back bit for bit."""
    from factory.runtime.checkpoint import Checkpointer, clone_tensors, read_checkpoint

    saved = clone_tensors(model.state_dict())
    with tempfile.TemporaryDirectory() as tmp:
        checkpointer = Checkpointer(Path(tmp), keep=1, ranks=ranks)
        path = checkpointer.save(1, {"model": model.state_dict()}, {}, {"fingerprint": "gpu"})
        with torch.no_grad():
            for param in model.parameters():
                param.zero_()
        state = {"model": model.state_dict()}
        read_checkpoint(path, state, "gpu")
    local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # noqa: E731
    differ = [k for k, v in state["model"].items() if not torch.equal(local(v), local(saved[k]))]
    ctx.record("checkpoint_round_trip", "equal" if not differ else f"{len(differ)} tensors differ")
    if differ:
        ctx.fail(f"DCP round trip changed {', '.join(differ[:5])}")


def run(ctx: SectionContext) -> None:
    ctx.record("backend", _join(ctx))
    try:
        blueprint, compiled, ranks = _laid_out(ctx)
        params = list(compiled.model.parameters())
        ctx.record("dtensor_parameters", sum(hasattr(p, "device_mesh") for p in params))
        ctx.record("parameters", len(params))
        _train(ctx, blueprint, compiled, ranks)
        _round_trip(ctx, compiled.model, ranks)
    finally:
        dist.destroy_process_group()


def markdown(results: dict[str, Any]) -> str:
    steps = results.get("step_s", [])
    rows = [[results.get("backend"), f"{results.get('dtensor_parameters')}/{results.get('parameters')}",
             ", ".join(f"{s * 1e3:.0f}" for s in steps),
             ", ".join(f"{x:.3f}" for x in results.get("lm_loss_after_each_step", [])),
             results.get("checkpoint_round_trip")]]  # fmt: skip
    return table(
        ["backend", "DTensor params", "step ms", "LM loss after each step", "DCP round trip"], rows
    )
