"""Mamba-2 state-space-duality (SSD) scan.

The recurrence, per batch row and head (``x_t`` is [p], ``B_t``/``C_t`` are [n]
and shared by the ``h/g`` heads of their group)::

    h_t = exp(dt_t * A) * h_{t-1} + dt_t * outer(x_t, B_t)      # state [p, n]
    y_t = h_t @ C_t + D * x_t

Three ways to evaluate it live here:

* :func:`ssd_sequential_scan`: the recurrence verbatim, one step per position.
  It is slow and exists as the independent reference for tests.
* :func:`ssd_chunked_scan_torch`: the SSD "chunked" form in pure PyTorch. The
  sequence is cut into chunks of ``chunk_size``; inside a chunk the output is a
  masked, decay-weighted attention-like product (quadratic in the chunk, so it
  maps onto matmuls), and only one state per chunk is carried across chunks.
* :func:`ssd_chunked_scan`: the entry point. It uses ``mamba_ssm``'s fused
  Triton kernel (``mamba_chunk_scan_combined``, loaded without the package's CUDA
  extension by ``factory.kernels.mamba_ssm_triton``) for CUDA tensors when it
  imports, and :func:`ssd_chunked_scan_torch` otherwise; :func:`ssd_kernel` says
  which, and why a CUDA run fell back.

``dt`` must already be activated (softplus plus bias, clamped) and positive, and
``A`` negative, so ``exp(dt * A)`` is a decay in (0, 1].

Packed sequences: ``seq_idx`` [batch, length] gives the document index of every
position (non-decreasing along the row). The state is reset where it changes,
so no document sees another's inputs: as ``mamba_ssm``'s ``seq_idx`` argument.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from factory.kernels.choice import KernelChoice
from factory.kernels.mamba_ssm_triton import serves, triton_module, unavailable

__all__ = [
    "ScanInputs",
    "fast_path_available",
    "ssd_chunked_scan",
    "ssd_chunked_scan_torch",
    "ssd_decode_steps",
    "ssd_kernel",
    "ssd_sequential_scan",
]

ScanResult = torch.Tensor | tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True, eq=False)
class ScanInputs:
    """The tensors of one scan, checked on construction (the einsums would fail less clearly).

    Args:
        x: inputs [batch, length, heads, head_dim].
        dt: step sizes [batch, length, heads], already softplus'ed and clamped (> 0).
        A: per-head decay rates [heads], negative.
        B, C: input and output projections [batch, length, groups, state]; group
            ``k`` serves heads ``k*h/g ... (k+1)*h/g - 1``.
        D: optional skip [heads] (or [heads, head_dim]) adding ``D * x``.
        initial_state: optional state before position 0, [batch, heads, head_dim, state].
        seq_idx: optional document index of every position [batch, length], non-decreasing;
            the state resets where it changes (packed documents stay apart).
    """

    x: torch.Tensor
    dt: torch.Tensor
    A: torch.Tensor
    B: torch.Tensor
    C: torch.Tensor
    D: torch.Tensor | None = None
    initial_state: torch.Tensor | None = None
    seq_idx: torch.Tensor | None = None

    def __post_init__(self) -> None:
        x, dt, A, B, C = self.x, self.dt, self.A, self.B, self.C
        if x.ndim != 4:
            raise ValueError(f"x must be [batch, length, heads, head_dim], got {tuple(x.shape)}")
        b, seqlen, h, p = x.shape
        if dt.shape != (b, seqlen, h):
            raise ValueError(f"dt must be {(b, seqlen, h)}, got {tuple(dt.shape)}")
        if A.shape != (h,):
            raise ValueError(f"A must be {(h,)}, got {tuple(A.shape)}")
        if B.ndim != 4 or B.shape[:2] != (b, seqlen) or B.shape != C.shape:
            raise ValueError(
                f"B and C must both be [{b}, {seqlen}, groups, state], "
                f"got {tuple(B.shape)} and {tuple(C.shape)}"
            )
        g, n = B.shape[2], B.shape[3]
        if g == 0 or h % g != 0:
            raise ValueError(f"heads ({h}) must be a multiple of groups ({g})")
        if self.D is not None and self.D.shape not in ((h,), (h, p)):
            raise ValueError(f"D must be {(h,)} or {(h, p)}, got {tuple(self.D.shape)}")
        state = self.initial_state
        if state is not None and state.shape != (b, h, p, n):
            raise ValueError(f"initial_state must be {(b, h, p, n)}, got {tuple(state.shape)}")
        if self.seq_idx is not None and self.seq_idx.shape != (b, seqlen):
            raise ValueError(f"seq_idx must be {(b, seqlen)}, got {tuple(self.seq_idx.shape)}")

    def compute_dtype(self) -> torch.dtype:
        """fp32, or fp64 when any input is fp64 (so float64 gradchecks stay exact)."""
        tensors = (self.x, self.dt, self.A, self.B, self.C, self.D, self.initial_state)
        if any(t is not None and t.dtype == torch.float64 for t in tensors):
            return torch.float64
        return torch.float32


def _check_chunk_size(chunk_size: int) -> None:
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")


def _skip_term(x: torch.Tensor, D: torch.Tensor) -> torch.Tensor:
    """``D * x`` with D per head [h] or per head and channel [h, p]."""
    return x * (D[:, None] if D.ndim == 1 else D)


def _pad_length(t: torch.Tensor, pad: int) -> torch.Tensor:
    """``t`` [b, l, ...] with ``pad`` zero positions appended (F.pad copies even for 0)."""
    return F.pad(t, (0, 0) * (t.ndim - 2) + (0, pad)) if pad else t


def _above_diagonal(size: int, device: torch.device) -> torch.Tensor:
    """bool [size, size], True where j > i: the positions a causal decay hides."""
    return torch.ones(size, size, dtype=torch.bool, device=device).triu(1)


def _decay(cum: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """exp(cum_i - cum_j), and 0 where ``hidden`` (bool, broadcasting to [..., l, l]) is True:
    [..., l] -> [..., l, l].

    A difference of prefix sums (as mamba_ssm's kernel does) costs one cumsum
    over l; the masked cumsum over an [l, l] grid it replaces, with its
    flip/cumsum/flip backward, was the scan's largest cost on CPU. Within one
    chunk the prefix sums stay small, so the subtraction loses no useful precision.
    The mask and the exponential go in place into the one fresh [l, l] tensor.
    """
    return (cum[..., :, None] - cum[..., None, :]).masked_fill_(hidden, float("-inf")).exp_()


class _IntraChunk(torch.autograd.Function):
    """``(exp(cum_i - cum_j), 0 where hidden) * cb @ x_dt``, the within-chunk term.

    The [b, c, g, r, l, l] weights are the scan's largest tensors, and on CPU their
    elementwise passes cost more than the matmul that reads them. Autograd's graph of
    sub/masked_fill/exp/mul makes about twelve passes over them (forward and backward);
    this one makes seven, in place where it can, with the backward written out:
    with M = L * cb and L = exp(S), dcb = sum_r dM * L and dS = dM * L * cb = dM * M.
    """

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        cum: torch.Tensor,
        cb: torch.Tensor,
        x_dt: torch.Tensor,
        hidden: torch.Tensor,
    ) -> torch.Tensor:
        # cum [b, c, g, r, l], cb [b, c, g, l, l], x_dt [b, c, g, r, l, p], hidden: bool
        # broadcasting to [.., l, l], True above the diagonal and across documents.
        decay = _decay(cum, hidden)
        weights = decay * cb[:, :, :, None]
        ctx.save_for_backward(decay, weights, cb, x_dt)
        return torch.matmul(weights, x_dt)

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None]:
        decay, weights, cb, x_dt = ctx.saved_tensors
        grad_x = torch.matmul(weights.transpose(-1, -2), grad)
        # Both products go in place into the one fresh [l, l] tensor, dM.
        grad_weights = torch.matmul(grad, x_dt.transpose(-1, -2)).mul_(decay)  # dM * L
        grad_cb = grad_weights.sum(3)
        grad_seg = grad_weights.mul_(cb[:, :, :, None])  # dM * M, 0 where hidden
        grad_cum = grad_seg.sum(-1) - grad_seg.sum(-2)
        return grad_cum, grad_cb, grad_x, None


def ssd_sequential_scan(inputs: ScanInputs, return_final_state: bool = False) -> ScanResult:
    """Reference SSD: the recurrence one position at a time.

    Same contract as :func:`ssd_chunked_scan`. Intended for tests and tiny inputs.
    """
    x, B, C, D, seq_idx = inputs.x, inputs.B, inputs.C, inputs.D, inputs.seq_idx
    b, seqlen, h, p = x.shape
    cdt = inputs.compute_dtype()
    xf, dtf, Af = x.to(cdt), inputs.dt.to(cdt), inputs.A.to(cdt)
    Bh = B.to(cdt).repeat_interleave(h // B.shape[2], dim=2)  # [b, l, h, n]
    Ch = C.to(cdt).repeat_interleave(h // C.shape[2], dim=2)
    init = inputs.initial_state
    state = xf.new_zeros(b, h, p, B.shape[3]) if init is None else init.to(cdt)
    ys = []
    for t in range(seqlen):
        if seq_idx is not None and t > 0:  # a new document starts from a zero state
            state = state * (seq_idx[:, t] == seq_idx[:, t - 1]).to(cdt)[:, None, None, None]
        decay = torch.exp(dtf[:, t] * Af)[:, :, None, None]
        inject = (dtf[:, t, :, None] * xf[:, t])[..., None] * Bh[:, t, :, None, :]
        state = decay * state + inject
        ys.append(torch.einsum("bhpn,bhn->bhp", state, Ch[:, t]))
    y = torch.stack(ys, dim=1) if ys else xf.new_zeros(b, 0, h, p)
    if D is not None:
        y = y + _skip_term(xf, D.to(cdt))
    y = y.to(x.dtype)
    return (y, state) if return_final_state else y


def ssd_decode_steps(inputs: ScanInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence over a few positions after ``inputs.initial_state`` (incremental
    decoding), keeping the state after every one: -> (y [b, l, h, p], states [b, l, h, p, n]
    fp32). A speculative verification keeps the state of the last position it accepts."""
    x, D = inputs.x, inputs.D
    b, length, h, p = x.shape
    cdt = inputs.compute_dtype()
    xf, dtf, Af = x.to(cdt), inputs.dt.to(cdt), inputs.A.to(cdt)
    Bh = inputs.B.to(cdt).repeat_interleave(h // inputs.B.shape[2], dim=2)
    Ch = inputs.C.to(cdt).repeat_interleave(h // inputs.C.shape[2], dim=2)
    init = inputs.initial_state
    state = xf.new_zeros(b, h, p, Bh.shape[3]) if init is None else init.to(cdt)
    ys, states = [], []
    for t in range(length):
        decay = torch.exp(dtf[:, t] * Af)[:, :, None, None]
        inject = (dtf[:, t, :, None] * xf[:, t])[..., None] * Bh[:, t, :, None, :]
        state = decay * state + inject
        states.append(state)
        ys.append(torch.einsum("bhpn,bhn->bhp", state, Ch[:, t]))
    y = torch.stack(ys, dim=1)
    if D is not None:
        y = y + _skip_term(xf, D.to(cdt))
    return y.to(x.dtype), torch.stack(states, dim=1)


def ssd_chunked_scan_torch(
    inputs: ScanInputs, chunk_size: int, return_final_state: bool = False
) -> ScanResult:
    """Pure-PyTorch chunked SSD (any device, differentiable); see :func:`ssd_chunked_scan`.

    Memory: the intra-chunk term materialises one [chunk, chunk] decay matrix
    per (batch, chunk, head), i.e. ``b * L_padded * h * chunk_size`` elements,
    the inherent cost of the SSD form. ``C·B`` is formed once per *group* and
    broadcast over the group's heads rather than repeating B and C per head.
    The inter-chunk pass uses a [chunks+1, chunks+1] decay matrix per (b, h),
    which is tiny next to the states it mixes.
    """
    _check_chunk_size(chunk_size)
    x, dt, A, B, C, D = inputs.x, inputs.dt, inputs.A, inputs.B, inputs.C, inputs.D
    b, seqlen, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    r = h // g  # heads per group
    cs = chunk_size
    cdt = inputs.compute_dtype()

    pad = (-seqlen) % cs
    nc = (seqlen + pad) // cs
    # Zero padding at the end is harmless: dt = 0 there, so the padded steps
    # neither decay the state (exp(0) = 1) nor inject into it, and the final
    # state equals the state after the last real position.
    xf, dtf, Bf, Cf = (_pad_length(t.to(cdt), pad) for t in (x, dt, B, C))

    # Head-major layouts, built once, make every product below a plain batched
    # matmul with no permute copies: x_dt [b, c, g, r, l, p], B and C [b, c, g, l, n].
    x_dt = (xf * dtf[..., None]).reshape(b, nc, cs, g, r, p).permute(0, 1, 3, 4, 2, 5)
    x_dt = x_dt.contiguous()
    Bc = Bf.reshape(b, nc, cs, g, n).transpose(2, 3).contiguous()
    Cc = Cf.reshape(b, nc, cs, g, n).transpose(2, 3).contiguous()
    dA = (dtf.reshape(b, nc, cs, g, r) * A.to(cdt).reshape(g, r)).permute(0, 1, 3, 4, 2)
    cum = dA.cumsum(-1)  # [b, c, g, r, l]: log-decay from the chunk start
    seq_idx = inputs.seq_idx
    docs = _Documents(seq_idx, pad, nc, cs) if seq_idx is not None else None

    # 1. Within each chunk: y_i += sum_{j<=i} (C_i·B_j) exp(cum_i - cum_j) dt_j x_j.
    cb = torch.matmul(Cc, Bc.transpose(-1, -2))  # per group, [b, c, g, l, l]
    upper = _above_diagonal(cs, x.device)
    hidden = upper if docs is None else upper | ~docs.same_within_chunk()
    y = _IntraChunk.apply(cum, cb, x_dt, hidden)  # [b, c, g, r, l, p]

    # 2. State each chunk leaves behind when started from zero: inputs decayed to its end.
    to_end = torch.exp(cum[..., -1:] - cum)  # [b, c, g, r, l]
    if docs is not None:  # only the chunk's last document reaches its end state
        to_end = to_end * docs.same_as_chunk_end()
    # The decay scales B, not x_dt: B per head [b, c, g, r, l, n] is what a broadcast of B
    # over the heads would copy anyway, and x_dt is then read as it is (transposed, no copy).
    b_to_end = Bc[:, :, :, None] * to_end[..., None]
    chunk_states = torch.matmul(x_dt.transpose(-1, -2), b_to_end)  # [b, c, g, r, p, n]

    # 3. Carry states across chunks: start(c) = sum_{z<=c} decay(z -> c) * s_z,
    #    where s_0 is the initial state and s_{z>0} the state chunk z-1 produced.
    init = (
        xf.new_zeros(b, 1, g, r, p, n)
        if inputs.initial_state is None
        else inputs.initial_state.to(cdt).reshape(b, 1, g, r, p, n)
    )
    all_states = torch.cat([init, chunk_states], dim=1)  # [b, c+1, g, r, p, n]
    chunk_total = F.pad(cum[..., -1], (0, 0, 0, 0, 1, 0))  # [b, c+1, g, r]
    chunk_cum = chunk_total.cumsum(1).permute(0, 2, 3, 1)  # [b, g, r, c+1]
    chunk_decay = _decay(chunk_cum, _above_diagonal(nc + 1, x.device))  # [b, g, r, c+1, c+1]
    if docs is not None:  # a state crosses chunks only inside one document
        chunk_decay = chunk_decay * docs.same_across_chunks()
    carried = torch.einsum("bgrcz,bzgrpn->bcgrpn", chunk_decay, all_states)
    starts, final_state = carried[:, :-1], carried[:, -1]

    # 4. Contribution of each chunk's start state: decay to position i, read by C_i.
    #    The decay scales C per head (as B above), and the product adds into y in the bmm.
    start_decay = torch.exp(cum) if docs is None else torch.exp(cum) * docs.same_as_chunk_start()
    c_start = (Cc[:, :, :, None] * start_decay[..., None]).view(-1, cs, n)
    starts_t = starts.reshape(-1, p, n).transpose(1, 2)
    y = torch.baddbmm(y.view(-1, cs, p), c_start, starts_t).view(b, nc, g, r, cs, p)
    y = y.permute(0, 1, 4, 2, 3, 5)  # back to [b, c, l, g, r, p]
    if D is not None:  # the skip term's fresh tensor takes y in place: no copy for the permute
        y = _skip_term(xf.view(b, nc, cs, h, p), D.to(cdt)).view_as(y).add_(y)
    y = y.reshape(b, nc * cs, h, p)[:, :seqlen].to(x.dtype)
    if return_final_state:
        return y, final_state.reshape(b, h, p, n)
    return y


class _Documents:
    """Masks that keep the chunked scan inside documents, from ``seq_idx`` [b, l].

    Chunk c starts from the state after position c*cs - 1 (the initial state for c = 0,
    which belongs to the first position's document); ``ends`` lists the document of each
    of those c+1 states. Documents are contiguous, so equal indices mean no boundary lies
    between two positions.
    """

    def __init__(self, seq_idx: torch.Tensor, pad: int, chunks: int, size: int) -> None:
        padded = F.pad(seq_idx, (0, pad), mode="replicate") if pad else seq_idx
        self.chunked = padded.reshape(seq_idx.shape[0], chunks, size)  # [b, c, l]
        self.ends = torch.cat([seq_idx[:, :1], self.chunked[:, :, -1]], dim=1)  # [b, c+1]

    def same_within_chunk(self) -> torch.Tensor:
        d = self.chunked
        return (d[..., :, None] == d[..., None, :])[:, :, None, None]  # [b, c, 1, 1, l, l]

    def same_as_chunk_end(self) -> torch.Tensor:
        d = self.chunked
        return (d == d[..., -1:])[:, :, None, None]  # [b, c, 1, 1, l]

    def same_across_chunks(self) -> torch.Tensor:
        e = self.ends
        return (e[:, :, None] == e[:, None, :])[:, None, None]  # [b, 1, 1, c+1, c+1]

    def same_as_chunk_start(self) -> torch.Tensor:
        start = self.ends[:, :-1, None]  # [b, c, 1]
        return (self.chunked == start)[:, :, None, None]  # [b, c, 1, 1, l]


SSD_MODULE = "ops.triton.ssd_combined"
TRITON = "mamba_ssm Triton (mamba_chunk_scan_combined)"
REFERENCE = "PyTorch chunked"
_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@functools.cache
def _kernel() -> Callable[..., ScanResult] | None:
    """``mamba_chunk_scan_combined`` outside ``torch.compile``'s graph (a graph break: its
    Python wrapper switches CUDA devices and runs autotuner hooks), None when it does not import."""
    module = triton_module(SSD_MODULE)
    return None if module is None else torch.compiler.disable(module.mamba_chunk_scan_combined)


def _choose(
    device: torch.device | str, dtype: torch.dtype | None, chunk_size: int | None
) -> tuple[Callable[..., ScanResult] | None, str | None]:
    """(mamba_ssm's kernel, None) where it serves tensors of ``dtype`` on ``device`` with chunks of
    ``chunk_size`` (None: not known yet, any the model may use); (None, why) where it should
    and cannot; (None, None) where the PyTorch path is the choice (CPU)."""
    if not serves(device):
        return None, None
    if dtype is not None and dtype not in _KERNEL_DTYPES:
        return None, f"{dtype} inputs (the kernel takes fp16, bf16 and fp32)"
    if chunk_size is not None and (chunk_size < 16 or chunk_size & (chunk_size - 1)):
        return None, f"chunk_size {chunk_size} (the kernel takes powers of two from 16)"
    kernel = _kernel()
    return (kernel, None) if kernel is not None else (None, unavailable(SSD_MODULE))


def fast_path_available(device: torch.device | str) -> bool:
    """True when ``mamba_ssm``'s Triton SSD kernel serves tensors on ``device`` (CUDA only;
    ``mamba_ssm`` is never imported for other devices)."""
    return _choose(device, None, None)[0] is not None


def ssd_chunked_scan(
    inputs: ScanInputs, chunk_size: int, return_final_state: bool = False
) -> ScanResult:
    """Mamba-2 SSD scan over a whole sequence (``inputs``: :class:`ScanInputs`).

    ``chunk_size`` is the chunk length; any length works (the tail chunk is zero-padded).
    Returns ``y`` [batch, length, heads, head_dim] in x's dtype, and with
    ``return_final_state`` also the final state [batch, heads, head_dim, state]
    in fp32 (fp64 on the pure path when an input is fp64). Arithmetic is fp32.
    """
    kernel, _ = _choose(inputs.x.device, inputs.x.dtype, chunk_size)
    if kernel is None:
        return ssd_chunked_scan_torch(inputs, chunk_size, return_final_state)
    # dt goes in activated (dt_softplus False, no dt_bias, no dt_limit): the kernel's cumsum
    # of dt * A is then the reference's, and dt's gradient flows back through our softplus.
    seq_idx = inputs.seq_idx
    out = kernel(
        inputs.x,
        inputs.dt,
        inputs.A,
        inputs.B,
        inputs.C,
        chunk_size,
        D=inputs.D,
        initial_states=inputs.initial_state,
        return_final_states=return_final_state,
        seq_idx=None if seq_idx is None else seq_idx.to(torch.int32),
    )
    if return_final_state:
        y, final_state = out
        return y, final_state.float()
    return out


def ssd_kernel(device: str, chunk_size: int | None = None) -> KernelChoice:
    """Which implementation :func:`ssd_chunked_scan` runs for tensors on ``device`` (of the
    mixer's dtypes, all served) with chunks of ``chunk_size``: the test the dispatch makes."""
    kernel, why = _choose(device, None, chunk_size)
    return KernelChoice("ssd scan", REFERENCE if kernel is None else TRITON, why)
