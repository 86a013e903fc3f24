"""The Mamba mixer's depthwise causal conv1d with document boundaries, as Triton kernels.

``y[b, t, c] = bias[c] + sum_j w[c, j] * x[b, t - (K-1) + j, c]``, where a tap that reaches
before the row's start or into another document (``seq_idx`` differs) reads zero: the values
of ``factory.layers.mamba.module._causal_depthwise_conv``. The input is read through its
strides ([B, L, C] as the in-projection's split leaves it, no copy), sums are fp32 in the
reference's order (bias, then the taps from the oldest), and the result is rounded once.

Why a kernel of our own rather than fla-core's ``causal_conv1d`` (pure Triton too) or
causal-conv1d (CUDA only): fla-core keeps documents apart through ``cu_seqlens`` over a
batch of one row, which needs the rows flattened and the boundaries turned into offsets
(built on the host, a synchronization per step, with a shape that changes with the data),
and it is a 1 MiB package whose import pulls in its layers, models and backends and whose
module layout moved between releases; mamba_ssm's seq_idx convention, which the scan takes,
is two comparisons here. Forward and backward are about 100 lines, exact to the
reference within fp32 rounding (tests/test_kernels_mamba_triton.py), with nothing to track.

The backward computes ``dx`` (each input position gathers the K outputs it fed, within its
document) and the weight gradient as per-span partial sums [B, spans, C, K] in fp32,
summed afterwards: no atomics, so the result is deterministic.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["causal_depthwise_conv"]

_TIME, _CHANNELS = 32, 64
_TILES_PER_SPAN = 8
"""The backward's program covers a span of 8 x 32 positions: its weight-gradient partials
take [B, L/256, C, K] fp32, an eighth of what one per 32 positions would."""


@triton.jit
def _tap_input(
    x_ptr, sxb, sxt, sxc, seq_ptr, ssb, sst, b, t, c, in_t, in_c, doc, shift,
    HAS_SEQ: tl.constexpr,
):  # fmt: skip
    """[BT, BC] fp32: x at ``t - shift`` for outputs ``t``, zero before the row's start and
    where that position is in another document than ``doc`` (the outputs' own)."""
    src = t - shift
    reads = in_t & (src >= 0)
    if HAS_SEQ:
        reads &= tl.load(seq_ptr + b * ssb + src * sst, mask=reads, other=-1) == doc
    return tl.load(
        x_ptr + b * sxb + src[:, None] * sxt + c[None, :] * sxc,
        mask=reads[:, None] & in_c[None, :],
        other=0.0,
    ).to(tl.float32)


@triton.jit
def _forward_kernel(
    x_ptr, sxb, sxt, sxc,  # the input [B, L, C] and its strides
    w_ptr, bias_ptr,  # weight [C, K] contiguous, bias [C]
    seq_ptr, ssb, sst,  # seq_idx [B, L] and its strides
    y_ptr,  # output [B, L, C], contiguous
    L, C,
    K: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_SEQ: tl.constexpr,
    BT: tl.constexpr, BC: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(2).to(tl.int64)
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    in_t, in_c = t < L, c < C
    acc = tl.zeros((BT, BC), dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + c, mask=in_c, other=0.0).to(tl.float32)[None, :]
    doc = t  # read only with seq_idx
    if HAS_SEQ:
        doc = tl.load(seq_ptr + b * ssb + t * sst, mask=in_t, other=-1)
    for j in tl.static_range(K):
        x = _tap_input(
            x_ptr, sxb, sxt, sxc, seq_ptr, ssb, sst, b, t, c, in_t, in_c, doc, K - 1 - j, HAS_SEQ
        )
        w = tl.load(w_ptr + c * K + j, mask=in_c, other=0.0).to(tl.float32)
        acc += x * w[None, :]
    out = y_ptr + (b * L + t[:, None]) * C + c[None, :]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=in_t[:, None] & in_c[None, :])


@triton.jit
def _backward_kernel(
    x_ptr, sxb, sxt, sxc,  # the forward's input [B, L, C] and its strides
    g_ptr, sgb, sgt, sgc,  # the output's gradient [B, L, C] and its strides
    w_ptr,  # weight [C, K] contiguous
    seq_ptr, ssb, sst,  # seq_idx [B, L] and its strides
    dx_ptr,  # input gradient [B, L, C], contiguous
    dw_ptr,  # fp32 weight-gradient partials [B, spans, C, K]
    L, C, SPANS,
    K: tl.constexpr, HAS_SEQ: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
    TILES: tl.constexpr,  # time tiles of BT per program (a span)
    KP: tl.constexpr,  # K rounded up to a power of two (a block's dimension)
):  # fmt: skip
    b = tl.program_id(2).to(tl.int64)
    span = tl.program_id(0)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    in_c = c < C
    # Each tap's weight gradient, summed over the span's tiles in registers: [BC] per tap.
    dw = tl.zeros((KP, BC), dtype=tl.float32)
    taps = tl.arange(0, KP)
    for tile in range(TILES):
        t = (span * TILES + tile) * BT + tl.arange(0, BT)
        in_t = t < L
        doc = t  # read only with seq_idx
        if HAS_SEQ:
            doc = tl.load(seq_ptr + b * ssb + t * sst, mask=in_t, other=-1)
        g_here = tl.load(
            g_ptr + b * sgb + t[:, None] * sgt + c[None, :] * sgc,
            mask=in_t[:, None] & in_c[None, :],
            other=0.0,
        ).to(tl.float32)
        dx = tl.zeros((BT, BC), dtype=tl.float32)
        for j in tl.static_range(K):
            shift = K - 1 - j
            w = tl.load(w_ptr + c * K + j, mask=in_c, other=0.0).to(tl.float32)
            # dx[s] += w[j] * g[s + shift]: the output that read position s through tap j.
            dst = t + shift
            fed = in_t & (dst < L)
            if HAS_SEQ:
                fed &= tl.load(seq_ptr + b * ssb + dst * sst, mask=fed, other=-1) == doc
            g = tl.load(
                g_ptr + b * sgb + dst[:, None] * sgt + c[None, :] * sgc,
                mask=fed[:, None] & in_c[None, :],
                other=0.0,
            ).to(tl.float32)
            dx += g * w[None, :]
            # dw[j] += g[t] * x[t - shift]: this tile's outputs, what tap j read for them.
            x = _tap_input(
                x_ptr, sxb, sxt, sxc, seq_ptr, ssb, sst, b, t, c, in_t, in_c, doc, shift, HAS_SEQ
            )
            dw += tl.where(taps[:, None] == j, tl.sum(g_here * x, axis=0)[None, :], 0.0)
        out = dx_ptr + (b * L + t[:, None]) * C + c[None, :]
        tl.store(out, dx.to(dx_ptr.dtype.element_ty), mask=in_t[:, None] & in_c[None, :])
    partials = dw_ptr + ((b * SPANS + span) * C + c[None, :]) * K + taps[:, None]
    tl.store(partials, dw, mask=(taps[:, None] < K) & in_c[None, :])


def _grid(batch: int, length: int, channels: int) -> tuple[int, int, int]:
    return triton.cdiv(length, _TIME), triton.cdiv(channels, _CHANNELS), batch


def _seq_args(seq_idx: torch.Tensor | None, x: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """seq_idx and its strides, or a placeholder pointer the kernel never reads."""
    if seq_idx is None:
        return x, 0, 0
    return seq_idx, seq_idx.stride(0), seq_idx.stride(1)


class _CausalConv(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        seq_idx: torch.Tensor | None,
    ) -> torch.Tensor:
        b, length, channels = x.shape
        taps = weight.reshape(channels, -1).contiguous()
        y = torch.empty(b, length, channels, dtype=x.dtype, device=x.device)
        seq, ssb, sst = _seq_args(seq_idx, x)
        _forward_kernel[_grid(b, length, channels)](
            x, *x.stride(), taps, x if bias is None else bias, seq, ssb, sst, y,
            length, channels, K=taps.shape[1], HAS_BIAS=bias is not None,
            HAS_SEQ=seq_idx is not None, BT=_TIME, BC=_CHANNELS,
        )  # fmt: skip
        ctx.save_for_backward(x, taps, seq_idx)
        ctx.weight_shape = weight.shape
        ctx.bias_dtype = None if bias is None else bias.dtype
        return y

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, None]:
        x, taps, seq_idx = ctx.saved_tensors
        b, length, channels = x.shape
        spans = triton.cdiv(length, _TIME * _TILES_PER_SPAN)
        grid = (spans, triton.cdiv(channels, _CHANNELS), b)
        dx = torch.empty(b, length, channels, dtype=x.dtype, device=x.device)
        partials = torch.empty(b, spans, channels, taps.shape[1], device=x.device)
        seq, ssb, sst = _seq_args(seq_idx, x)
        _backward_kernel[grid](
            x, *x.stride(), grad, *grad.stride(), taps, seq, ssb, sst, dx, partials,
            length, channels, spans, K=taps.shape[1], HAS_SEQ=seq_idx is not None,
            BT=_TIME, BC=_CHANNELS, TILES=_TILES_PER_SPAN,
            KP=triton.next_power_of_2(taps.shape[1]),
        )  # fmt: skip
        grad_weight = partials.sum((0, 1)).reshape(ctx.weight_shape).to(taps.dtype)
        bias_dtype = ctx.bias_dtype
        grad_bias = None if bias_dtype is None else grad.float().sum((0, 1)).to(bias_dtype)
        return dx, grad_weight, grad_bias, None


def causal_depthwise_conv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    seq_idx: torch.Tensor | None = None,
) -> torch.Tensor:
    """Depthwise causal conv1d over ``x`` [B, L, C] with ``weight`` [C, 1, K] (or [C, K]) and
    ``bias`` [C]; with ``seq_idx`` [B, L] (non-decreasing document indices) no tap crosses
    into another document. -> [B, L, C] in x's dtype, differentiable in x, weight and bias."""
    return _CausalConv.apply(x, weight, bias, seq_idx)
