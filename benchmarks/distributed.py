"""Proxy training throughput per parallel layout on 1, 2 and 4 gloo processes of this machine.

Each layout trains the Super CPU proxy (``factory train super --proxy``'s model,
width 256, seq 256, global batch 8 of micro-batch 2; precision off) on random
tokens for ``--steps`` optimizer steps after ``--warmup`` steps, through the
same pieces as ``factory train``: ``parallelize`` (or the pipeline's stages),
``forward_backward`` with :class:`~factory.runtime.ranks.DistributedRanks`,
the global gradient norm, and AdamW. Reported per layout: tokens/s (the global
batch's tokens over rank 0's median step time) and the **communication share**:
the self CPU time rank 0's main thread spends in collectives over one extra
step, as ``torch.profiler`` records it, over that step's wall time: the
``c10d::`` and ``_c10d_functional::`` ops (issue and wait: all-to-all, send,
receive, all-reduce) and FSDP2's ``FSDP::all_gather`` / ``FSDP::post_backward_reduce``
regions (the waits for its gathers and reduce-scatters, with their copy-in/out). On this 2-core machine more processes cannot make
a step faster: the point is what each layout's communication costs.

``python -m benchmarks distributed [--steps N] [--warmup N] [--only NAME,...]``
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

COMMUNICATION = ("c10d::", "_c10d_functional::", "FSDP::all_gather", "FSDP::post_backward_reduce")

LAYOUTS: dict[str, tuple[int, dict[str, Any]]] = {
    "one process": (1, {}),
    "DP=2 (FSDP2)": (2, {}),
    "DP=2 (DDP)": (2, {"distributed_optimizer": False}),
    "EP=2": (2, {"ep": 2}),
    "TP=2 + SP": (2, {"tp": 2, "sequence_parallel": True, "etp": 1}),
    "ETP=2": (2, {"etp": 2}),
    "PP=2 (1F1B)": (2, {"pp": 2}),
    "DP=4 (FSDP2)": (4, {}),
    "DP=2 x EP=2": (4, {"ep": 2}),
    "EP=2 x ETP=2": (4, {"ep": 2, "etp": 2}),
}


def _blueprint(world: int, parallelism: dict[str, Any]) -> Any:
    import factory
    from factory.proxy import derive_proxy
    from factory.schemas.blueprint import Blueprint

    data = derive_proxy(factory.load_blueprint("super")).model_dump(exclude_unset=True)
    data["parallelism"].update(world_size=world, **parallelism)
    if parallelism.get("pp", 1) > 1:  # cut the proxy's stack in two at its middle
        main, *mtp = data["model"]["pattern"].split("/")
        half = len(main) // 2
        data["model"]["pattern"] = "/".join([main[:half] + "|" + main[half:], *mtp])
    return Blueprint.model_validate(data)


def _model(bp: Any, world: int) -> tuple[Any, Any]:
    import factory
    from factory.runtime.ranks import SingleProcess

    compiled = factory.compile(bp, precision="off", seed=0)
    if world == 1:
        return compiled, SingleProcess()
    from factory.distributed.mesh import build_meshes
    from factory.planner.layout import resolve_layout
    from factory.runtime.placement import lay_out
    from factory.runtime.ranks import DistributedRanks

    ranks = DistributedRanks(build_meshes(resolve_layout(bp), "cpu"))
    lay_out(compiled, ranks)
    return compiled, ranks


def _step(compiled: Any, ranks: Any, micro: list[Any], optimizer: Any, mtp: float) -> None:
    from factory.runtime.step import forward_backward

    optimizer.zero_grad()
    objective = compiled.blueprint.training.objective
    forward_backward(compiled.model, micro, mtp, ranks, objective.loss_average)
    optimizer.grads_to_masters()
    ranks.grad_norm(optimizer.masters)
    optimizer.step()


def measure_step(rank: int, world: int, bp: Any, steps: int, warmup: int) -> dict[str, float]:
    import numpy as np
    from torch.profiler import ProfilerActivity, profile

    from factory.data.shards.shard_reader import Sample
    from factory.graph.loss import mtp_loss_scale
    from factory.runtime.batches import collate
    from factory.runtime.optimizer import MasterOptimizer

    compiled, ranks = _model(bp, world)
    optimizer = MasterOptimizer(compiled.model, bp.training.optimizer)
    par, seq = bp.parallelism, bp.data.seq_len
    count = par.global_batch_size // par.micro_batch_size // ranks.data_size
    rng = np.random.default_rng(ranks.data_rank)

    def sample() -> Sample:  # one document of random tokens, every position a label
        tokens = rng.integers(0, bp.model.vocab_size, seq, dtype=np.int32)
        return Sample(tokens, np.ones(seq, np.uint8), np.array([0, seq], np.int32))

    micro = [collate([sample() for _ in range(par.micro_batch_size)]) for _ in range(count)]
    mtp = mtp_loss_scale(bp.model)
    times = []
    for i in range(warmup + steps):
        start = time.perf_counter()
        _step(compiled, ranks, micro, optimizer, mtp)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        _step(compiled, ranks, micro, optimizer, mtp)
        wall = time.perf_counter() - start
    comm_us = sum(
        e.self_cpu_time_total for e in prof.key_averages() if e.key.startswith(COMMUNICATION)
    )
    return {"median_s": statistics.median(times), "comm_share": comm_us / 1e6 / wall}


def main(argv: list[str]) -> int:
    from benchmarks.machine import describe
    from factory.distributed.local import run_ranks

    parser = argparse.ArgumentParser(prog="python -m benchmarks distributed")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--only", default="", help="comma-separated layout names")
    args = parser.parse_args(argv)
    chosen = [n for n in LAYOUTS if not args.only or n in args.only.split(",")]
    print(f"machine: {describe()}")
    print(f"{'layout':16s} {'procs':>5s} {'tokens/s':>9s} {'step s':>7s} {'comm share':>10s}")
    for name in chosen:
        world, parallelism = LAYOUTS[name]
        bp = _blueprint(world, parallelism)
        if world == 1:
            torch.set_num_threads(1)  # as each rank of a launch is (OMP_NUM_THREADS=1)
            result = measure_step(0, 1, bp, args.steps, args.warmup)
        else:
            result = run_ranks(measure_step, world, bp, args.steps, args.warmup, timeout=900)[0]
        tokens = bp.parallelism.global_batch_size * bp.data.seq_len
        print(
            f"{name:16s} {world:5d} {tokens / result['median_s']:9.0f} "
            f"{result['median_s']:7.2f} {result['comm_share']:10.0%}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    import sys

    raise SystemExit(main(sys.argv[1:]))
