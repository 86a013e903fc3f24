"""Run a function on N gloo processes of this machine, with a timeout.

No launcher needed: ``factory build``'s distributed check
(``factory.jobs.build_distributed``), the multi-process tests and the
benchmarks run their ranks with it.
``run_ranks(fn, world_size, *args)`` starts ``world_size`` spawned processes
that each join one gloo process group and call ``fn(rank, world_size, *args)``;
it returns the values in rank order. An exception on any rank is re-raised
here with that rank's traceback; a run past ``timeout`` seconds is killed and
fails (a hung collective must fail the test, not stall CI). ``fn`` must be a
top-level function of an importable module (a test module is).
"""

from __future__ import annotations

import datetime
import os
import pickle
import queue
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from factory.rank_process import end_if_rank_process, mark_rank_process

__all__ = ["free_port", "run_ranks"]

COLLECTIVE_TIMEOUT_S = 60


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _entry(fn: Callable[..., Any], rank: int, world: int, port: int, args: tuple, out: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))  # fmt: skip
    torch.set_num_threads(1)  # N processes share this machine's cores
    try:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
        mark_rank_process()
        # Plain pickle: by value (torch's queue pickler shares storage through file
        # descriptors, which die with this process).
        out.put((rank, True, pickle.dumps(fn(rank, world, *args))))
    except BaseException:  # reported to the parent, whatever it was
        out.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    out.close()
    out.join_thread()  # the report is in the pipe before the process ends
    end_if_rank_process(0)


def run_ranks(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 180
) -> list[Any]:
    """``[fn(0, W, *args), ..., fn(W-1, W, *args)]``, each on its own gloo rank."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_entry, args=(fn, rank, world_size, port, args, out), daemon=True)
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world_size:
            try:
                rank, ok, value = out.get(timeout=1.0)
            except queue.Empty:
                dead = [
                    r for r, p in enumerate(procs) if p.exitcode is not None and r not in results
                ]
                if dead:  # died before reporting (killed, or failed to start)
                    codes = ", ".join(f"rank {r}: exit {procs[r].exitcode}" for r in dead)
                    message = f"{world_size} ranks: ended without a result ({codes})"
                    raise RuntimeError(message) from None
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"{world_size} ranks: no result within {timeout} s (a hang?); "
                        f"got ranks {sorted(results)}"
                    ) from None
                continue
            if not ok:
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            results[rank] = pickle.loads(value)
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
    return [results[rank] for rank in range(world_size)]
