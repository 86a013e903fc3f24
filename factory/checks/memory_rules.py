"""Does the planned peak rank fit in the chosen GPU's memory?

A warning, not an error: the planner's activation model is an estimate
(``factory.planner.memory``), and frameworks have levers it does not model
(offloading, FSDP, CUDA-graph pools).
"""

from __future__ import annotations

from collections.abc import Iterator

from factory.checks.registry import Finding, rule
from factory.planner.layout import resolve_layout
from factory.planner.memory import memory_per_rank
from factory.schemas.blueprint import Blueprint
from factory.schemas.parallelism import GPU_SPECS

GiB = 2**30
MAX_CP = 1024
"""The largest context-parallel size the hint below tries (Super's long context uses 64)."""


@rule("memory.fits_gpu")
def fits_in_memory(bp: Blueprint) -> Iterator[Finding]:
    """The peak rank's weights, gradients, optimizer state and activations fit the GPU."""
    capacity = GPU_SPECS[bp.parallelism.gpu].memory_bytes
    plan = memory_per_rank(bp, resolve_layout(bp))
    if plan.total > capacity:
        state = plan.total - plan.activations.total
        yield Finding(
            "parallelism.world_size",
            f"pipeline rank {plan.peak_rank} needs {plan.total / GiB:.1f} GiB "
            f"(weights+grads+optimizer {state / GiB:.1f} GiB, "
            f"activations {plan.activations.total / GiB:.1f} GiB) but one {bp.parallelism.gpu} "
            f"has {capacity / GiB:.0f} GiB; add ranks, raise tp/pp/ep, or recompute more"
            + (_context_parallel_hint(bp, capacity) if plan.activations.total > state else ""),
            "warning",
        )


def _context_parallel_hint(bp: Blueprint, capacity: int) -> str:
    """Where activations dominate, what splitting the sequence would do: the smallest larger
    ``parallelism.cp`` the world size and sequence allow whose peak rank fits, by the same
    estimate (a long-context stage is the case: activations grow with ``data.seq_len``)."""
    par, seq_len = bp.parallelism, bp.data.seq_len
    cp = par.cp * 2
    while cp <= MAX_CP and seq_len % (2 * cp) == 0 and par.world_size % (par.tp * cp * par.pp) == 0:
        candidate = bp.model_copy(
            update={"parallelism": par.model_copy(update={"cp": cp, "dp": None})}
        )
        total = memory_per_rank(candidate, resolve_layout(candidate)).total
        if total <= capacity:
            return (
                f"; activations grow with the sequence ({seq_len:,} tokens): context "
                f"parallelism splits it, and parallelism.cp={cp} brings the peak rank to "
                f"{total / GiB:.1f} GiB"
            )
        cp *= 2
    return (
        f"; activations grow with the sequence ({seq_len:,} tokens): context parallelism "
        "(parallelism.cp) splits it across ranks"
    )
