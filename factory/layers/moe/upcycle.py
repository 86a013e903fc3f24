"""Dense-to-MoE upcycling: an ``E`` layer seeded from the dense MLP at the same place.

Follows He et al. 2024, "Upcycling Large Language Models into Mixture of
Experts" (arXiv:2410.07524): virtual-group initialisation for fine-grained
experts, weight scaling, and softmax-then-top-K routing. The MoE blueprint's
pattern is the dense one with some ``-`` layers written ``E`` (MTP layers
included); ``factory.graph.upcycle`` copies every other tensor by name and
hands each MoE layer here (``MixtureOfExperts.upcycle``).

Shards. A dense MLP is ``y = D act(U x)`` with ``U`` [F, d], ``D`` [d, F] and
an elementwise ``act`` (relu2; swiglu's gate matrix is sharded like ``U``).
Cutting the F hidden units into G = F / f shards of the expert width f gives
``y = sum_j D_j act(U_j x)``: ``U_j`` rows ``j*f:(j+1)*f`` of ``U``, ``D_j``
the same columns of ``D``. The E = n*G experts hold n copies of the G shards,
copy-major (expert ``e = c*G + j`` is shard j of copy c), with ``down_proj``
scaled by ``alpha``, so one whole copy sums to ``alpha * dense(x)``.

Virtual groups. All router rows of a copy are equal (``r_e = w_c``), so the G
shards of a copy share one score ``p_c`` (sigmoid is elementwise; equal logits
have equal softmax). With ``top_k = m*G`` the top-k then takes m whole copies,
because scores tie only inside a copy; every shard is used equally. The routed
output is ``s * alpha * sum_{c in C} q_c * dense(x)``, ``s`` the scaling factor
and ``q_c`` the routing weight of each of copy c's experts.

Mode 1, renormalised (``normalize_top_k`` and top_k > 1; sigmoid or softmax):
``q_c = p_c / (G * sum_{C} p_c)``, so the output is ``(s * alpha / G) dense(x)``
whatever the router: ``alpha = G / s``, ``w_c ~ N(0, init.std)`` drawn per
copy, expert bias 0. Exact. At init the output ignores the router, so its only
gradient is the aux loss; copies see different tokens, so their experts drift
apart, and then the router gets a task gradient.

Mode 2, not renormalised (the paper's softmax-then-top-K; also sigmoid, or
top_k = 1): the output depends on the router unless it starts uniform, so
``w_c = 0``: every score is ``p0`` (1/E for softmax, 1/2 for sigmoid) and
``alpha = 1 / (s * p0 * m)`` (softmax: ``E*G / (top_k*s)``). Equal scores tie
everywhere, so the expert bias (which only ranks experts) is set equal within
a copy and strictly decreasing across copies (steps of 1e-4 * p0: far above
fp32 resolution at p0, far below the bias update rate), choosing copies
0..m-1. This needs ``router.expert_bias``. Exact. The router gets a task
gradient from the first step; only the chosen copies train until it moves.

The shared expert starts as a no-op (``down_proj`` 0, ``up_proj`` random) so
the sum stays exact. "Exact" means equal up to float rounding (sums run in a
different order). Not exact: tokens dropped by ``capacity_factor`` (mode 2
sends every token to the same m copies, so it drops unless the factor is at
least E / top_k), and a tie at the cut between copies in mode 1 (probability
0). Refused: LatentMoE (the experts see a learned d -> latent projection, not
x), non-zero dense biases (experts have none), a G that is not whole, E or
top_k not multiples of G, group-limited routing whose groups split a copy.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from factory.layers.moe.module import MoE
from factory.spec.layer_type import UpcycleError

__all__ = ["upcycle_moe"]

_TIE_STEP = 1e-4
"""Expert-bias step between consecutive copies in mode 2, relative to the uniform score."""


def _tensor(state: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
    if name not in state:
        raise UpcycleError(f"the source has no {name}, needed to upcycle that MLP")
    return state[name].float()


def _shards(matrix: torch.Tensor, groups: int, copies: int) -> torch.Tensor:
    """[F, d] -> [copies*G, F/G, d]: row blocks of ``matrix``, copy-major."""
    rows, width = matrix.shape
    return matrix.reshape(groups, rows // groups, width).repeat(copies, 1, 1)


@torch.no_grad()
def upcycle_moe(
    moe: MoE,
    state: Mapping[str, torch.Tensor],
    name: str,
    generator: torch.Generator,
    std: float,
) -> None:
    """Overwrite ``moe`` (fp32) from the dense MLP stored under ``name`` in ``state``: the
    construction of the module docstring. ``generator`` draws the router rows (mode 1)."""
    cfg, router = moe.cfg, moe.cfg.router
    if cfg.latent_size is not None:
        raise UpcycleError(
            f"{name}: LatentMoE (latent_size {cfg.latent_size}) cannot reproduce a "
            f"{moe.gate.weight.shape[1]}-wide dense MLP; upcycle into a MoE without latent_size"
        )
    up = _tensor(state, f"{name}.up_proj.weight")
    down = _tensor(state, f"{name}.down_proj.weight")
    has_gate = f"{name}.gate_proj.weight" in state
    if has_gate != (cfg.activation == "swiglu"):
        dense = "swiglu" if has_gate else "relu2"
        raise UpcycleError(f"{name}: dense MLP is {dense} but the experts are {cfg.activation}")
    for proj in ("up_proj", "down_proj", "gate_proj"):
        bias = state.get(f"{name}.{proj}.bias")
        if bias is not None and bias.count_nonzero():
            raise UpcycleError(f"{name}: the dense {proj} has a bias; routed experts have none")
    width = moe.gate.weight.shape[1]
    hidden, f = up.shape[0], cfg.expert_intermediate_size
    if up.shape[1] != width or down.shape != (width, hidden):
        raise UpcycleError(
            f"{name}: dense MLP shapes up {tuple(up.shape)}, down {tuple(down.shape)} do not "
            f"fit hidden_size {width}"
        )
    if hidden % f:
        raise UpcycleError(
            f"{name}: granularity G = dense width {hidden} / expert_intermediate_size {f} "
            f"is not a whole number"
        )
    g = hidden // f
    experts, top_k = cfg.num_experts, cfg.top_k
    if experts % g or top_k % g:
        raise UpcycleError(
            f"{name}: num_experts ({experts}) and top_k ({top_k}) must be multiples of the "
            f"granularity G = {hidden} / {f} = {g}, so that the router picks whole copies"
        )
    if router.num_groups > 1 and (experts // router.num_groups) % g:
        raise UpcycleError(
            f"{name}: each of the {router.num_groups} router groups must hold whole copies "
            f"of the G = {g} shards ({experts // router.num_groups} experts per group)"
        )
    copies, chosen, scale = experts // g, top_k // g, router.scaling_factor
    if router.normalize_top_k and top_k > 1:  # mode 1: exact for any router rows
        alpha = g / scale
        rows = torch.randn(copies, width, generator=generator) * std
        bias = torch.zeros(copies)
    else:  # mode 2: a uniform router, ties broken by the expert bias
        if not router.expert_bias:
            raise UpcycleError(
                f"{name}: without top-k renormalisation the upcycled MoE reproduces the dense "
                f"MLP only from a uniform router, whose tied scores need router.expert_bias "
                f"to pick whole copies; set expert_bias: true or normalize_top_k: true"
            )
        p0 = 1 / experts if router.score_function == "softmax" else 0.5
        alpha = 1 / (scale * p0 * chosen)
        rows = torch.zeros(copies, width)
        bias = -_TIE_STEP * p0 * torch.arange(copies, dtype=torch.float32)
    moe.gate.weight.copy_(rows.repeat_interleave(g, 0))
    moe.gate.e_score_correction_bias.copy_(bias.repeat_interleave(g))
    moe.experts.up_proj.copy_(_shards(up, g, copies))
    moe.experts.down_proj.copy_(_shards(down.t() * alpha, g, copies).transpose(1, 2))
    if moe.experts.gate_proj is not None:
        moe.experts.gate_proj.copy_(_shards(_tensor(state, f"{name}.gate_proj.weight"), g, copies))
    if moe.shared_experts is not None:
        moe.shared_experts.down_proj.weight.zero_()
        if moe.shared_experts.down_proj.bias is not None:
            moe.shared_experts.down_proj.bias.zero_()
