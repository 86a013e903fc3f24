"""Grouped MoE expert compute without a Python loop over experts.

A router picks ``k`` experts per token, giving ``T*k`` (token, slot) pairs.
:func:`route_tokens` sorts those pairs by expert (a stable sort, so the layout
is a pure function of the routing) and keeps what is needed to undo the sort.
:func:`grouped_mlp` then runs every expert's MLP on its own tokens in a few
batched matmuls and combines the weighted results per token.

Why pad-and-bmm: experts receive different token counts, so their matmuls are
ragged. Copying each expert's tokens into an [E, max_count, d] buffer (zeros
elsewhere) turns the ragged set into one ``torch.bmm`` per projection, which
every device and dtype supports, autograd included, with a launch count that
does not grow with E. The price is wasted work and memory on the padding:
``E * max_count`` rows instead of ``T*k``, up to ``E/k`` times more when the
routing is badly skewed. ``torch._grouped_mm`` runs the ragged matmuls with no
padding; it is used on CUDA when a one-off probe shows it works there for the
dtype (and can be requested explicitly with ``impl="grouped_mm"``).

The ``_grouped_mm`` path never synchronizes with the host: the sort, the counts
(a ``searchsorted`` over the sorted experts), the offsets (their int32 cumsum,
a device tensor) and the gathers that sort and unsort the pairs all have sizes
fixed by ``T``, ``k`` and ``E``, so ``torch.compile`` traces the whole MoE
block as one graph. The padded path reads its buffer size (the largest count)
on the host; it stays for the quantized GEMM hooks, which take [E, C, in]
batches.

The per-token combine gathers each pair's output back into (token, slot) order
and sums over the ``k`` slots in fp32. That is the same sum an fp32
``index_add_`` scatter would form, but in a fixed order without atomics, so the
result is bitwise reproducible on GPU as well as CPU.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Literal

import torch
import torch.nn.functional as F

__all__ = [
    "Activation",
    "Dispatch",
    "ExpertWeights",
    "activate",
    "combine",
    "gather_pairs",
    "grouped_mlp",
    "grouped_mm_problem",
    "grouped_mm_sorted",
    "grouped_mm_works",
    "relu_squared",
    "route_tokens",
    "unsort_pairs",
]

Activation = Literal["relu2", "swiglu"]
Impl = Literal["auto", "bmm", "grouped_mm"]


@dataclass(frozen=True, eq=False)
class Dispatch:
    """Expert-sorted layout of the ``T*k`` (token, slot) pairs of one routing.

    A *pair index* ``q = token * k + slot`` names a pair in the router's order;
    a *sorted position* names it after the stable sort by expert. Every tensor
    here has a size fixed by ``T``, ``k`` and ``E`` alone and lives on the
    routing's device: building a dispatch reads nothing back to the host (only
    :attr:`max_tokens_per_expert`, which the padded path needs, does).
    """

    num_tokens: int
    top_k: int
    num_experts: int
    order: torch.Tensor
    """[T*k] sorted position -> pair index (the stable argsort by expert)."""
    inverse_order: torch.Tensor
    """[T*k] pair index -> sorted position; undoes ``order``."""
    token_index: torch.Tensor
    """[T*k] sorted position -> source token."""
    expert_index: torch.Tensor
    """[T*k] sorted position -> expert (non-decreasing)."""
    rank_in_expert: torch.Tensor
    """[T*k] sorted position -> 0-based rank among that expert's pairs."""
    tokens_per_expert: torch.Tensor
    """[E] int64 pairs routed to each expert (for load-balancing statistics)."""

    @property
    def offsets(self) -> torch.Tensor:
        """[E] int32 end of each expert's run of sorted pairs: ``torch._grouped_mm``'s
        ``offs``, on the device."""
        return torch.cumsum(self.tokens_per_expert, 0, dtype=torch.int32)

    @cached_property
    def max_tokens_per_expert(self) -> int:
        """Largest entry of ``tokens_per_expert`` (the padded buffer's row count). Reading it
        syncs with the host, once per dispatch: only the padded-bmm path (and CPU's choice
        of path where ``_grouped_mm`` is not verified) asks."""
        return int(self.tokens_per_expert.max()) if self.tokens_per_expert.numel() else 0

    @property
    def slot_index(self) -> torch.Tensor:
        """[T*k] sorted position -> routing slot of the pair."""
        return self.order % self.top_k

    def padded_rows(self, capacity: int) -> torch.Tensor:
        """[T*k] sorted position -> row of a flattened [E, capacity, ...] buffer."""
        return self.expert_index * capacity + self.rank_in_expert

    def unpermute(self, sorted_values: torch.Tensor) -> torch.Tensor:
        """Values in sorted order [T*k, ...] -> router order [T, k, ...]."""
        unsorted = sorted_values[self.inverse_order]
        return unsorted.reshape(self.num_tokens, self.top_k, *sorted_values.shape[1:])


def route_tokens(top_k_index: torch.Tensor, num_experts: int, *, check: bool = True) -> Dispatch:
    """Sort the (token, slot) pairs of ``top_k_index`` [T, k] by expert.

    With ``check`` (the default), raises ValueError for an index outside
    ``[0, num_experts)``, at the cost of one device-to-host read. ``check=False``
    is for indices that cannot be out of range (a top-k over ``num_experts``
    scores, as the MoE router's): then nothing is read back to the host and every
    shape follows from ``T``, ``k`` and ``E``, so ``torch.compile`` traces it in one
    graph. The counts come from a ``searchsorted`` over the sorted experts rather
    than ``bincount`` (whose CUDA kernel reads the largest index to size its
    output) or an atomic scatter.
    """
    if top_k_index.ndim != 2:
        raise ValueError(f"top_k_index must be [tokens, k], got {tuple(top_k_index.shape)}")
    if top_k_index.dtype.is_floating_point or top_k_index.dtype == torch.bool:
        raise ValueError(f"top_k_index must be an integer tensor, got {top_k_index.dtype}")
    if num_experts < 1:
        raise ValueError(f"num_experts must be >= 1, got {num_experts}")
    num_tokens, top_k = top_k_index.shape
    flat = top_k_index.reshape(-1).long()
    pairs = flat.numel()
    device = flat.device
    if check and pairs:
        lo, hi = torch.stack([flat.min(), flat.max()]).tolist()
        if lo < 0 or hi >= num_experts:
            raise ValueError(f"expert indices must lie in [0, {num_experts}), got [{lo}, {hi}]")

    order = torch.argsort(flat, stable=True)
    expert_index = flat[order]
    experts = torch.arange(num_experts, device=device)
    expert_start = torch.searchsorted(expert_index, experts)
    expert_end = torch.searchsorted(expert_index, experts, right=True)
    positions = torch.arange(pairs, device=device)
    # A permutation's inverse by scatter: each position is written once, no accumulation.
    inverse_order = torch.empty_like(order).scatter_(0, order, positions)
    return Dispatch(
        num_tokens=num_tokens,
        top_k=top_k,
        num_experts=num_experts,
        order=order,
        inverse_order=inverse_order,
        token_index=order // max(top_k, 1),
        expert_index=expert_index,
        rank_in_expert=positions - expert_start.index_select(0, expert_index),
        tokens_per_expert=expert_end - expert_start,
    )


class _GatherPairs(torch.autograd.Function):
    """Token rows [T, d] -> their pairs sorted by expert [T*k, d], a gather whose gradient is
    also a gather: the pairs' gradients back in router order, summed over the k slots. The
    plain ``index_select``'s backward is an ``index_add_``, which on CUDA adds a token's k
    gradients with float atomics in no fixed order; this sum has one order everywhere."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        x: torch.Tensor,
        token_index: torch.Tensor,
        inverse_order: torch.Tensor,
        top_k: int,
    ) -> torch.Tensor:
        ctx.save_for_backward(inverse_order)
        ctx.shape = (x.shape[0], top_k, x.shape[1])
        return x.index_select(0, token_index)

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor
    ) -> tuple[torch.Tensor, None, None, None]:
        (inverse_order,) = ctx.saved_tensors
        by_pair = grad.index_select(0, inverse_order)
        return by_pair.view(ctx.shape).sum(1), None, None, None


class _Permute(torch.autograd.Function):
    """Rows reordered by a permutation ``index`` (``out[i] = rows[index[i]]``); the gradient
    goes back through ``inverse`` as a gather too, with no scatter-add."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        rows: torch.Tensor,
        index: torch.Tensor,
        inverse: torch.Tensor,
    ) -> torch.Tensor:
        ctx.save_for_backward(inverse)
        return rows.index_select(0, index)

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor
    ) -> tuple[torch.Tensor, None, None]:
        (inverse,) = ctx.saved_tensors
        return grad.index_select(0, inverse), None, None


def gather_pairs(x: torch.Tensor, dispatch: Dispatch) -> torch.Tensor:
    """Token rows [T, d] -> one row per pair in sorted order [T*k, d] (each expert's run
    contiguous), with a deterministic gradient (the k slots summed in slot order)."""
    if dispatch.top_k == 0:
        return x.new_zeros(0, x.shape[1])
    return _GatherPairs.apply(x, dispatch.token_index, dispatch.inverse_order, dispatch.top_k)


def unsort_pairs(sorted_rows: torch.Tensor, dispatch: Dispatch) -> torch.Tensor:
    """Pair rows in sorted order [T*k, d] -> router order [T*k, d], gathers both ways."""
    return _Permute.apply(sorted_rows, dispatch.inverse_order, dispatch.order)


class _ReluSquared(torch.autograd.Function):
    """relu(h)^2 with its gradient 2 * relu(h) * grad from the one saved relu(h).

    Autograd's square then relu backward makes three passes over the expert activations;
    this makes two. Scaling by 2 is exact, so the gradient is bit for bit autograd's.
    """

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, h: torch.Tensor) -> torch.Tensor:
        r = torch.relu(h)
        ctx.save_for_backward(r)
        return r.square()

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> torch.Tensor:
        (r,) = ctx.saved_tensors
        return (grad * r).mul_(2)


def relu_squared(h: torch.Tensor) -> torch.Tensor:
    """relu(h)^2, Nemotron's non-gated squared ReLU."""
    return _ReluSquared.apply(h)


def activate(h: torch.Tensor, g: torch.Tensor | None, activation: Activation) -> torch.Tensor:
    """relu2: relu(up x)^2. swiglu: silu(gate x) * (up x)."""
    if activation == "relu2":
        return relu_squared(h)
    assert g is not None
    return F.silu(g) * h


ExpertLinear = Callable[[str, torch.Tensor, torch.Tensor], torch.Tensor]
"""``(projection name, x [E, C, in], w [E, out, in]) -> [E, C, out]``: one grouped GEMM."""


@dataclass(frozen=True, eq=False)
class ExpertWeights:
    """The routed experts of one layer as 3-D weights, checked on construction."""

    up: torch.Tensor
    """[E, ff, d_in]"""
    down: torch.Tensor
    """[E, d_in, ff]"""
    activation: Activation = "relu2"
    """``"relu2"`` (``relu(up x)^2``, Nemotron's experts) or ``"swiglu"`` (``silu(gate x) * up x``)."""
    gate: torch.Tensor | None = None
    """[E, ff, d_in], swiglu only."""

    def __post_init__(self) -> None:
        experts, ff, d_in = self.up.shape
        if self.down.shape != (experts, d_in, ff):
            raise ValueError(
                f"expected down {(experts, d_in, ff)} for up {tuple(self.up.shape)}, "
                f"got {tuple(self.down.shape)}"
            )
        if self.activation not in ("relu2", "swiglu"):
            raise ValueError(f"activation must be 'relu2' or 'swiglu', got {self.activation!r}")
        if (self.activation == "swiglu") != (self.gate is not None):
            raise ValueError("gate is required for swiglu and not accepted for relu2")
        if self.gate is not None and self.gate.shape != self.up.shape:
            raise ValueError(
                f"gate must match up {tuple(self.up.shape)}, got {tuple(self.gate.shape)}"
            )

    def mlp(self, x: torch.Tensor, matmul: ExpertLinear) -> torch.Tensor:
        """``down(act(up x))`` (with ``gate x`` for swiglu), each product ``matmul(name, x, w)``."""
        h = matmul("up_proj", x, self.up)
        g = matmul("gate_proj", x, self.gate) if self.gate is not None else None
        return matmul("down_proj", activate(h, g, self.activation), self.down)


def _plain_bmm(name: str, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.bmm(x, w.transpose(1, 2))


def _experts_padded_bmm(
    x: torch.Tensor, dispatch: Dispatch, experts: ExpertWeights, linear: ExpertLinear | None = None
) -> torch.Tensor:
    """Expert outputs per pair, in router order [T*k, d_in], via a padded buffer and bmm."""
    capacity = dispatch.max_tokens_per_expert
    d_in = x.shape[1]
    rows = dispatch.padded_rows(capacity)
    buffer = x.new_zeros(dispatch.num_experts * capacity, d_in)
    # index_select, not advanced indexing: its backward is an index_add_, where advanced
    # indexing's is index_put_(accumulate=True), several times slower on CPU.
    buffer = buffer.index_copy(0, rows, x.index_select(0, dispatch.token_index))
    buffer = buffer.view(dispatch.num_experts, capacity, d_in)
    out = experts.mlp(buffer, linear or _plain_bmm)
    return out.reshape(-1, d_in).index_select(0, rows[dispatch.inverse_order])


def _experts_grouped_mm(
    x: torch.Tensor, dispatch: Dispatch, experts: ExpertWeights
) -> torch.Tensor:
    """Same as :func:`_experts_padded_bmm` through ``torch._grouped_mm`` (no padding): no host
    sync, and every shape is ``T*k`` rows."""
    return unsort_pairs(grouped_mm_sorted(gather_pairs(x, dispatch), dispatch, experts), dispatch)


def grouped_mm_sorted(xs: torch.Tensor, dispatch: Dispatch, experts: ExpertWeights) -> torch.Tensor:
    """The expert MLPs on pairs sorted by expert [T*k, d] -> [T*k, d], one ``_grouped_mm``
    per projection over the experts' runs."""
    offsets = dispatch.offsets

    def grouped(name: str, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        w = w.transpose(1, 2)
        if torch.compiler.is_compiling() and not _meta_traces(x, w):
            return _traced_grouped_mm(x, w, offsets)
        return torch._grouped_mm(x, w, offs=offsets)

    return experts.mlp(xs, grouped)


def _meta_traces(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether torch.compile can trace ``_grouped_mm(a, b)`` itself: its meta kernel applies
    CUDA's rules on every device, BF16 with 16-byte-aligned rows only
    (``torch/_meta_registrations.py``, ``_meta_grouped_mm_common``)."""
    aligned = all(n * a.dtype.itemsize % 16 == 0 for n in (a.shape[-1], b.shape[-1]))
    return a.dtype == b.dtype == torch.bfloat16 and aligned


@torch.library.custom_op("factory::grouped_mm", mutates_args=())
def _traced_grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``_grouped_mm(a [M, K], b [E, K, N], offs)`` -> [M, N] as an opaque op with its own
    shape rule, so torch.compile traces it where the meta kernel refuses (fp32 on CPU; the
    eager kernel runs these there, verified by :func:`grouped_mm_works`)."""
    return torch._grouped_mm(a.contiguous(), b, offs=offs)


@_traced_grouped_mm.register_fake
def _(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return a.new_empty(a.shape[0], b.shape[-1])


@torch.library.custom_op("factory::grouped_mm_weight_grad", mutates_args=())
def _grouped_mm_weight_grad(
    a: torch.Tensor, grad: torch.Tensor, offs: torch.Tensor
) -> torch.Tensor:
    """Per group ``a_g^T grad_g``: [M, K], [M, N] -> [E, K, N], ``_grouped_mm`` over the
    contraction (what its own backward computes for the weight)."""
    return torch._grouped_mm(a.t(), grad.contiguous(), offs=offs)


@_grouped_mm_weight_grad.register_fake
def _(a: torch.Tensor, grad: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return a.new_empty(offs.shape[0], a.shape[1], grad.shape[1])


def _traced_grouped_mm_setup(ctx: Any, inputs: tuple[torch.Tensor, ...], output: Any) -> None:
    a, b, offs = inputs
    ctx.save_for_backward(a, b, offs)


def _traced_grouped_mm_backward(
    ctx: Any, grad: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, None]:
    a, b, offs = ctx.saved_tensors
    grad_a = _traced_grouped_mm(grad, b.transpose(1, 2), offs)
    return grad_a, _grouped_mm_weight_grad(a, grad, offs), None


_traced_grouped_mm.register_autograd(
    _traced_grouped_mm_backward, setup_context=_traced_grouped_mm_setup
)


_GROUPED_MM_WORKS: dict[tuple[str, torch.dtype], bool] = {}


def grouped_mm_works(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether ``torch._grouped_mm`` runs and matches the bmm path here (probed once, cached).

    The probe runs forward and backward on a small routing with an empty
    expert and compares against the padded-bmm path; any error means False.
    """
    device = torch.device(device)
    key = (device.type, dtype)
    if torch.compiler.is_compiling():
        # The probe runs eagerly before tracing (``RoutedExperts.sync_free``, which decides
        # whether a block compiles, asks first); tracing it would break the graph.
        return _GROUPED_MM_WORKS.get(key, False)
    if key not in _GROUPED_MM_WORKS:
        # The probe runs a backward: asked first under no_grad (an evaluation, decoding), it
        # would fail and cache False for the whole process.
        with torch.inference_mode(False), torch.enable_grad():
            _GROUPED_MM_WORKS[key] = _probe_grouped_mm(device, dtype)
    return _GROUPED_MM_WORKS[key]


def _probe_grouped_mm(device: torch.device, dtype: torch.dtype) -> bool:
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:
        gen = torch.Generator().manual_seed(0)
        tokens, d_in, ff, experts = 24, 16, 32, 4
        x = torch.randn(tokens, d_in, generator=gen).to(device, dtype)
        up = (torch.randn(experts, ff, d_in, generator=gen) / 4).to(device, dtype)
        down = (torch.randn(experts, d_in, ff, generator=gen) / 4).to(device, dtype)
        index = torch.randint(0, experts - 1, (tokens, 2), generator=gen).to(device)
        dispatch = route_tokens(index, experts)  # the last expert gets no tokens
        results = []
        for fn in (_experts_grouped_mm, _experts_padded_bmm):
            leaves = [t.clone().requires_grad_() for t in (x, up, down)]
            out = fn(leaves[0], dispatch, ExpertWeights(leaves[1], leaves[2]))
            out.float().square().sum().backward()
            results.append([out.float(), *(t.grad.float() for t in leaves)])
        tol = 1e-4 if dtype == torch.float32 else 5e-2
        return all(
            torch.allclose(a, b, rtol=tol, atol=tol * b.abs().max().item())
            for a, b in zip(*results, strict=True)
        )
    except Exception:  # unsupported device, dtype, layout or build
        return False


def grouped_mm_problem(
    device: torch.device | str,
    dtype: torch.dtype,
    d_in: int,
    ff: int,
) -> str | None:
    """Why ``torch._grouped_mm`` cannot run the experts of width ``d_in`` and ffn ``ff`` in
    ``dtype`` on ``device``, or None when it can: the one test behind the sync-free path,
    asked by the dispatch, the kernel report and whether an MoE block compiles (eager or
    traced alike: where torch.compile's own rule refuses, :func:`grouped_mm_sorted` traces
    the same kernel as an opaque op)."""
    device = torch.device(device)
    if not hasattr(torch, "_grouped_mm"):
        return "this torch has no torch._grouped_mm"
    # Its kernels (CUDA's and CPU's) want 16-byte-aligned rows.
    aligned = all(width * dtype.itemsize % 16 == 0 for width in (d_in, ff))
    if not aligned:
        return f"expert widths {d_in} and {ff} are not 16-byte aligned in {dtype}"
    if not grouped_mm_works(device, dtype):
        return f"torch._grouped_mm does not run or differs from bmm on {device.type} in {dtype}"
    return None


def _use_grouped_mm(impl: Impl, x: torch.Tensor, experts: ExpertWeights) -> bool:
    if impl == "bmm":
        return False
    if impl == "grouped_mm":
        if not hasattr(torch, "_grouped_mm"):
            raise RuntimeError("impl='grouped_mm' but this torch has no torch._grouped_mm")
        return True
    # "auto": only where verified (CPU's choice by load is ``layers.moe.experts``').
    weights = (experts.up, experts.down, experts.gate)
    return (
        x.device.type == "cuda"
        and all(w is None or w.is_contiguous() for w in weights)
        and grouped_mm_problem(x.device, x.dtype, x.shape[1], experts.up.shape[1]) is None
    )


def grouped_mlp(
    x: torch.Tensor,
    dispatch: Dispatch,
    experts: ExpertWeights,
    weights: torch.Tensor | None = None,
    *,
    impl: Impl = "auto",
    linear: ExpertLinear | None = None,
) -> torch.Tensor:
    """Routed expert MLPs, combined per token: ``y_t = sum_j w_tj * MLP_{e_tj}(x_t)``.

    Args:
        x: token activations [T, d_in].
        dispatch: from :func:`route_tokens` on the same [T, k] routing.
        experts: the experts' weights and activation, one per expert of the dispatch.
        weights: routing weights [T, k]; None sums the experts unweighted.
        impl: ``"auto"`` (grouped_mm on CUDA where verified, else padded bmm),
            ``"bmm"`` or ``"grouped_mm"`` to force one path.
        linear: runs each expert GEMM instead of ``torch.bmm`` (a quantized GEMM,
            ``factory.precision``); it implies the padded bmm path, whose zero
            padding rows leave amaxes and products unchanged.

    Returns:
        [T, d_in] in x's dtype. Expert matmuls run in x's dtype; the weighting
        and the sum over slots run in fp32 (fp64 for fp64 inputs). Gradients
        reach x, the experts' weights and the routing weights. Load statistics are on
        ``dispatch.tokens_per_expert``.
    """
    num_tokens, d_in = x.shape
    if num_tokens != dispatch.num_tokens:
        raise ValueError(f"x has {num_tokens} tokens but the dispatch has {dispatch.num_tokens}")
    if experts.up.shape[0] != dispatch.num_experts or experts.up.shape[2] != d_in:
        raise ValueError(
            f"expected up [{dispatch.num_experts}, ff, {d_in}], got {tuple(experts.up.shape)}"
        )
    if weights is not None and weights.shape != (num_tokens, dispatch.top_k):
        raise ValueError(
            f"weights must be {(num_tokens, dispatch.top_k)}, got {tuple(weights.shape)}"
        )

    if linear is None and _use_grouped_mm(impl, x, experts):
        pair_out = _experts_grouped_mm(x, dispatch, experts)
    else:
        pair_out = _experts_padded_bmm(x, dispatch, experts, linear)
    return combine(pair_out, dispatch, weights, x.dtype)


def combine(
    pair_out: torch.Tensor, dispatch: Dispatch, weights: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    """[T*k, d] router order -> [T, d] in ``dtype``: the weighted sum over the k slots in fp32
    (fp64 for fp64), the same ops whichever path computed the pairs, so all round alike."""
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    pair_out = pair_out.to(acc).reshape(dispatch.num_tokens, dispatch.top_k, pair_out.shape[-1])
    if weights is not None:
        pair_out = pair_out * weights.to(acc)[..., None]
    return pair_out.sum(dim=1).to(dtype)
