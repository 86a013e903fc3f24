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


@rule("memory.fits_gpu")
def fits_in_memory(bp: Blueprint) -> Iterator[Finding]:
    """The peak rank's weights, gradients, optimizer state and activations fit the GPU."""
    capacity = GPU_SPECS[bp.parallelism.gpu].memory_bytes
    plan = memory_per_rank(bp, resolve_layout(bp))
    if plan.total > capacity:
        yield Finding(
            "parallelism.world_size",
            f"pipeline rank {plan.peak_rank} needs {plan.total / GiB:.1f} GiB "
            f"(weights+grads+optimizer {(plan.total - plan.activations.total) / GiB:.1f} GiB, "
            f"activations {plan.activations.total / GiB:.1f} GiB) but one {bp.parallelism.gpu} "
            f"has {capacity / GiB:.0f} GiB; add ranks, raise tp/pp/ep, or recompute more",
            "warning",
        )
