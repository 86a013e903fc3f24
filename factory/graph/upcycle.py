"""Dense-to-MoE upcycling: seed every ``E`` layer from the dense MLP at the same place.

Follows He et al. 2024, "Upcycling Large Language Models into Mixture of
Experts" (arXiv:2410.07524): virtual-group initialisation for fine-grained
experts, weight scaling, and softmax-then-top-K routing. The MoE blueprint's
pattern is the dense one with some ``-`` layers written ``E`` (MTP layers
included); every other tensor is copied by name.

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

import torch

from factory.graph.blocks import Block
from factory.graph.hybrid_lm import HybridLM
from factory.layers.moe.module import MoE

__all__ = ["UpcycleError", "upcycle"]

_TIE_STEP = 1e-4
"""Expert-bias step between consecutive copies in mode 2, relative to the uniform score."""
_SYMBOLS = (("A_log", "M"), ("q_proj.weight", "*"), ("gate.weight", "E"), ("up_proj.weight", "-"))


class UpcycleError(ValueError):
    """The dense checkpoint cannot seed this MoE model."""


def _source_symbol(state: dict[str, torch.Tensor], mixer: str) -> str:
    """The pattern symbol of the mixer stored under ``mixer`` in the source, or '?'."""
    return next((symbol for leaf, symbol in _SYMBOLS if f"{mixer}.{leaf}" in state), "?")


@torch.no_grad()
def upcycle(model: HybridLM, source: dict[str, torch.Tensor], generator: torch.Generator) -> None:
    """Overwrite ``model`` (an MoE blueprint's, built in fp32) from a dense ``source`` state dict.

    ``generator`` draws the router rows (mode 1). Raises :class:`UpcycleError`
    when the source does not fit; the module docstring has the construction.
    """
    state = dict(source)
    if model.cfg.tie_embeddings and "backbone.embeddings.weight" in state:
        state.setdefault("lm_head.weight", state["backbone.embeddings.weight"])
    for name, block in model.named_modules():
        if not isinstance(block, Block):
            continue
        found = _source_symbol(state, f"{name}.mixer")
        if block.symbol == "E" and found != "-":
            raise UpcycleError(
                f"source layer {name} is not a dense MLP (found {found!r}): an 'E' layer "
                f"upcycles from the '-' layer at the same place"
            )
        if block.symbol != "E" and found not in (block.symbol, "?"):
            raise UpcycleError(
                f"layer {name} is {block.symbol!r} in the blueprint but {found!r} in the source: "
                f"the source pattern must be the blueprint's with the upcycled 'E' layers as '-'"
            )
    moes = {name: m for name, m in model.named_modules() if isinstance(m, MoE)}
    _copy_by_name(model, state, tuple(f"{name}." for name in moes))
    for name, moe in moes.items():
        _upcycle_moe(name, moe, state, generator, model.cfg.init.std)


def _copy_by_name(model: HybridLM, state: dict[str, torch.Tensor], skip: tuple[str, ...]) -> None:
    own = {k: v for k, v in model.state_dict().items() if not k.startswith(skip)}
    theirs = {k for k in state if not k.startswith(skip)}
    missing = sorted(own.keys() - theirs)
    unexpected = sorted(theirs - own.keys())
    shapes = [
        f"{k}: source {tuple(state[k].shape)} vs model {tuple(t.shape)}"
        for k, t in own.items()
        if k in state and state[k].shape != t.shape
    ]
    if missing or unexpected or shapes:
        problems = [
            *(f"missing {k}" for k in missing[:5]),
            *(f"unexpected {k}" for k in unexpected[:5]),
            *shapes[:5],
        ]
        raise UpcycleError(
            f"the source does not fit outside the MoE layers ({len(missing)} missing, "
            f"{len(unexpected)} unexpected, {len(shapes)} mis-shaped): " + "; ".join(problems)
        )
    for name, tensor in own.items():
        tensor.copy_(state[name].to(tensor.dtype))


def _tensor(state: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    if name not in state:
        raise UpcycleError(f"the source has no {name}, needed to upcycle that MLP")
    return state[name].float()


def _shards(matrix: torch.Tensor, groups: int, copies: int) -> torch.Tensor:
    """[F, d] -> [copies*G, F/G, d]: row blocks of ``matrix``, copy-major."""
    rows, width = matrix.shape
    return matrix.reshape(groups, rows // groups, width).repeat(copies, 1, 1)


def _upcycle_moe(
    name: str, moe: MoE, state: dict[str, torch.Tensor], generator: torch.Generator, std: float
) -> None:
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
