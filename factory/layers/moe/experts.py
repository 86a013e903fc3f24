"""Routed expert GEMMs: three ways to run the ragged per-expert matmuls, chosen by the load.

``route_tokens`` sorts the ``T*k`` (token, slot) pairs by expert; expert ``e`` then owns a
contiguous run of ``n_e`` pairs. The three paths compute the same expert MLPs on those runs:

- ``padded_bmm``: copy the runs into an ``[E, max n_e, d]`` zero-padded buffer, one ``bmm``
  per projection (``factory.kernels.moe_dispatch.grouped_mlp``). Few ops, but it multiplies
  ``E * max n_e`` rows instead of ``T*k``: free when balanced, up to ``E/k`` times the work
  when one expert takes every token.
- ``grouped_mm``: ``torch._grouped_mm`` over the sorted pairs with offsets, no padding.
- ``per_expert``: one ``mm`` per non-empty expert on its run, no padding.

Which one is fastest was measured, not guessed (``python -m benchmarks train_step
--experts``; numbers in ``docs/architecture.md``, 'Expert GEMM path'). :func:`choose_path`
applies the rule derived from them.

Only ``grouped_mm`` runs without a host sync (padded bmm reads the largest count to size
its buffer, per-expert the counts to split the runs), so it is the path on every device
where it is verified, and the one ``torch.compile`` traces (``RoutedExperts.sync_free``).
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

from factory.kernels.moe_dispatch import (
    Dispatch,
    ExpertWeights,
    gather_pairs,
    grouped_mm_problem,
    grouped_mm_sorted,
    unsort_pairs,
)

__all__ = ["PATHS", "ExpertPath", "choose_path", "pair_outputs"]

ExpertPath = Literal["padded_bmm", "grouped_mm", "per_expert"]
PATHS: tuple[ExpertPath, ...] = ("padded_bmm", "grouped_mm", "per_expert")

PER_EXPERT_ROWS = 64
"""Padding rows one extra per-expert ``mm`` call is worth on CPU: padded bmm spends ~0.01 ms
per buffer row (fwd + bwd at d=128, ff=256) and a per-expert call ~0.8 ms of fixed cost."""


def choose_path(dispatch: Dispatch, x: torch.Tensor, ff: int) -> ExpertPath:
    """The path for experts of ffn width ``ff`` on this routing: ``_grouped_mm`` on any device
    where it is verified for the dtype and widths (:func:`grouped_mm_problem`: a probe against
    padded bmm, forward and backward, cached), the one path with no host sync; on CPU it is
    also as fast as padded bmm when the load is even and 3-6x faster when skewed
    (``docs/architecture.md``, 'Expert GEMM path'). Without it, CPU takes padded bmm until
    its padding rows outweigh the per-expert calls' fixed cost (reading the counts on the
    host); other devices take padded bmm, which these CPU numbers say nothing against."""
    if grouped_mm_problem(x.device, x.dtype, x.shape[1], ff) is None:
        return "grouped_mm"
    pairs = dispatch.num_tokens * dispatch.top_k
    if x.device.type != "cpu" or pairs == 0:
        return "padded_bmm"
    wasted = dispatch.num_experts * dispatch.max_tokens_per_expert - pairs
    used = int((dispatch.tokens_per_expert > 0).sum())
    return "padded_bmm" if wasted <= PER_EXPERT_ROWS * used else "per_expert"


def _per_expert(xs: torch.Tensor, dispatch: Dispatch, experts: ExpertWeights) -> torch.Tensor:
    """Sorted pairs [T*k, d] -> expert outputs, sorted [T*k, d], one ``mm`` per expert."""
    counts = dispatch.tokens_per_expert.tolist()
    outs = []
    for e, run in enumerate(xs.split(counts)):
        if counts[e] == 0:
            continue  # an empty expert costs nothing and its weights get a zero gradient
        outs.append(experts.mlp(run, lambda name, x, w, e=e: F.linear(x, w[e])))
    return torch.cat(outs) if outs else xs.new_zeros(0, experts.down.shape[1])


def pair_outputs(
    path: ExpertPath, x: torch.Tensor, dispatch: Dispatch, experts: ExpertWeights
) -> torch.Tensor:
    """Expert output of every (token, slot) pair in router order [T*k, d] by an unpadded path.

    The pairs are sorted and unsorted by gathers whose gradients are gathers too
    (``gather_pairs``, ``unsort_pairs``): no scatter-add, so the gradients are deterministic
    on every device, and ``_grouped_mm`` gets the contiguous gradient its CPU backward needs
    (an expanded one fails there with 'Invalid strides')."""
    run = grouped_mm_sorted if path == "grouped_mm" else _per_expert
    return unsort_pairs(run(gather_pairs(x, dispatch), dispatch, experts), dispatch)
