"""FP8 fake-quantization as Triton kernels, bit-exact with ``factory.kernels.fp8``.

Two recipes, each quantize-and-dequantize in one pass over the elements:

* :func:`fake_quantize_tensorwise`: current per-tensor scaling (TE
  ``Float8CurrentScaling``), one scale per matrix of ``[..., rows, cols]`` from its
  amax (or a given one), in Transformer Engine's order: ``scale = FP8_MAX / amax``
  (``FLT_MAX`` where that overflows, 1 for a zero amax), ``scale_inv = 1 / scale``,
  ``out = fp8(clamp(x * scale)) * scale_inv``; the values of
  ``fp8.quantize_tensorwise(m).dequantize()`` for each matrix ``m``.
* :func:`fake_quantize_mxfp8`: OCP MXFP8 (TE ``MXFP8BlockScaling``), one E8M0
  scale ``2**e`` per 32 elements of the last dim, ``e = floor(log2(block_amax)) -
  emax`` clamped to [-127, 127] (-127 for a zero block); the values of
  ``fp8.quantize_mxfp8(x).dequantize()``.

Both refuse non-finite input with ValueError, as the emulation does. Rounding to
FP8 is the integer-exact ``triton_tiles.round_to_fp8``, divisions are ``div_rn``
(TE's ``__fdiv_rn``), the product ``x * scale`` reaches the rounding only through
``abs`` and ``min`` (so it is never contracted into an FMA), and powers of two are
built from their bit patterns, so the interpreter and compiled code agree bit for bit; scaling by a power of two is exact in fp32
except where the result is an fp32 subnormal, which rounds once, as the
emulation's float64 product rounds once on its way to fp32.

Subnormals matter here (a block whose amax is below 2**-119 uses the scale
2**-127, itself subnormal): compiled for sm_90 the kernels keep them (no
``.ftz``, checked in ``tests/test_kernels_triton.py``). A compiled run's bits and
speed are checked on the device by ``python -m benchmarks gpu`` (``BENCHMARKS.md``, gpu).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from factory.kernels import fp8
from factory.kernels.triton_tiles import (
    launch_options,
    round_to_fp8,
    tile_amax,
    tile_grid,
    with_sign_of,
)

__all__ = ["fake_quantize_mxfp8", "fake_quantize_tensorwise", "matrix_amax"]

#: Per format: (mantissa bits, smallest normal, rounding constant of the subnormal grid).
_GRID = {"e4m3": (3, 2.0**-6, 2.0**14), "e5m2": (2, 2.0**-14, 2.0**7)}
_FP32_MAX = tl.constexpr(torch.finfo(torch.float32).max)
_ROWS, _COLS = 32, 64


@triton.jit
def _to_fp8_and_back(y, scale, MANT, MIN_NORMAL, MAGIC, MAX):
    """``fp8(clamp(y)) * scale`` with y's sign (-0 included)."""
    return with_sign_of(round_to_fp8(tl.abs(y), MANT, MIN_NORMAL, MAGIC, MAX) * scale, y)


@triton.jit
def _tensorwise_kernel(
    x_ptr, R, C, sb, sr, sc,  # the input [B, R, C] and its strides
    amax_ptr,  # fp32 [B]
    out_ptr,  # fp32 [B, R, C], contiguous
    BR: tl.constexpr, BC: tl.constexpr,
    MANT: tl.constexpr, MIN_NORMAL: tl.constexpr, MAGIC: tl.constexpr, MAX: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    b = tl.program_id(1)
    npc = tl.cdiv(C, BC)
    rows = (pid // npc) * BR + tl.arange(0, BR)[:, None]
    cols = (pid % npc) * BC + tl.arange(0, BC)[None, :]
    mask = (rows < R) & (cols < C)
    x = tl.load(
        x_ptr + b.to(tl.int64) * sb + rows.to(tl.int64) * sr + cols * sc, mask=mask, other=0.0
    )
    amax = tl.load(amax_ptr + b)
    scale = tl.div_rn(tl.full([], MAX, tl.float32), amax)
    scale = tl.where(scale == float("inf"), _FP32_MAX, scale)
    scale = tl.where(amax == 0.0, 1.0, scale)
    scale_inv = tl.div_rn(tl.full([], 1.0, tl.float32), scale)
    y = x.to(tl.float32) * scale
    out = _to_fp8_and_back(y, scale_inv, MANT, MIN_NORMAL, MAGIC, MAX)
    tl.store(out_ptr + b.to(tl.int64) * R * C + rows.to(tl.int64) * C + cols, out, mask=mask)


def _grid_args(fmt: str) -> dict:
    mant, min_normal, magic = _GRID[fmt]
    return {"MANT": mant, "MIN_NORMAL": min_normal, "MAGIC": magic, "MAX": fp8.FP8_MAX[fmt]}


def _check(x: torch.Tensor, fmt: str, ndim: int) -> None:
    if fmt not in fp8.FP8_MAX:
        raise ValueError(f"fmt must be one of {sorted(fp8.FP8_MAX)}, got {fmt!r}")
    if not torch.is_floating_point(x) or x.ndim < ndim or x.numel() == 0:
        raise ValueError(f"expected a non-empty float tensor of >= {ndim} dims, got {x.shape}")


def matrix_amax(x: torch.Tensor) -> torch.Tensor:
    """fp32 [B]: max |x| of each matrix of ``x [..., rows, cols]`` (ValueError if non-finite)."""
    _check(x, "e4m3", 2)
    return tile_amax(x.reshape(-1, *x.shape[-2:]), 1, None, "fp8 quantization")


def fake_quantize_tensorwise(
    x: torch.Tensor, fmt: fp8.FP8Format = "e4m3", amax: torch.Tensor | None = None
) -> torch.Tensor:
    """fp32 values of FP8 current scaling of each matrix of ``x [..., rows, cols]``.
    ``amax``: fp32 [B] (one per matrix) to use instead of their own, e.g. all-reduced
    over a split tensor; the input's finiteness is then not checked."""
    _check(x, fmt, 2)
    x3 = x.reshape(-1, *x.shape[-2:])
    b, rows, cols = x3.shape
    if amax is None:
        amax = matrix_amax(x3)
    amax = amax.to(device=x.device, dtype=torch.float32).reshape(-1).expand(b).contiguous()
    out = torch.empty((b, rows, cols), dtype=torch.float32, device=x.device)
    grid = tile_grid(rows, cols, _ROWS, _COLS, b)
    _tensorwise_kernel[grid](
        x3, rows, cols, *x3.stride(), amax, out,
        BR=_ROWS, BC=_COLS, **_grid_args(fmt), **launch_options(),
    )  # fmt: skip
    return out.reshape(x.shape)


@triton.jit
def _pow2(e):
    """Exact ``2.0 ** e`` in fp32 for integer ``e`` in [-149, 127], from its bit pattern."""
    bits = tl.where(e >= -126, (e + 127) << 23, 1 << tl.minimum(tl.maximum(e + 149, 0), 30))
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _mxfp8_kernel(
    x_ptr, R, C, sr, sc,  # the input [R, C] and its strides
    out_ptr,  # fp32 [R, C], contiguous
    bad_ptr,  # int32, one slot per program: its count of non-finite elements
    BR: tl.constexpr, NB: tl.constexpr, EMAX: tl.constexpr,
    MANT: tl.constexpr, MIN_NORMAL: tl.constexpr, MAGIC: tl.constexpr, MAX: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    npc = tl.cdiv(C, NB * 32)
    rows = (pid // npc) * BR + tl.arange(0, BR)[:, None, None]
    cols = (pid % npc) * (NB * 32) + tl.arange(0, NB)[None, :, None] * 32
    cols = cols + tl.arange(0, 32)[None, None, :]
    mask = (rows < R) & (cols < C)
    x = tl.load(x_ptr + rows.to(tl.int64) * sr + cols * sc, mask=mask, other=0.0)
    x = x.to(tl.float32)
    a = tl.abs(x)
    bad = ((a != a) | (a == float("inf"))).to(tl.int32)
    tl.store(bad_ptr + pid, tl.sum(tl.reshape(bad, [BR * NB * 32]), axis=0))
    block_amax = tl.max(a, axis=2)
    exponent = ((block_amax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    e = tl.where(block_amax == 0.0, -127, tl.minimum(tl.maximum(exponent - EMAX, -127), 127))
    y = x * _pow2(-e)[:, :, None]
    out = _to_fp8_and_back(y, _pow2(e)[:, :, None], MANT, MIN_NORMAL, MAGIC, MAX)
    tl.store(out_ptr + rows.to(tl.int64) * C + cols, out, mask=mask)


def fake_quantize_mxfp8(x: torch.Tensor, fmt: fp8.FP8Format = "e4m3") -> torch.Tensor:
    """fp32 values of MXFP8 quantization of ``x`` (blocks of 32 along the last dim; a
    shorter tail block is scaled from its own elements)."""
    _check(x, fmt, 1)
    x2 = x.reshape(-1, x.shape[-1])
    rows, cols = x2.shape
    out = torch.empty((rows, cols), dtype=torch.float32, device=x.device)
    nb = _COLS // 32
    grid = tile_grid(rows, cols, _ROWS, nb * 32, 1)
    bad = torch.empty(grid[0], dtype=torch.int32, device=x.device)
    _mxfp8_kernel[grid](
        x2, rows, cols, *x2.stride(), out, bad,
        BR=_ROWS, NB=nb, EMAX=fp8.MX_EMAX[fmt], **_grid_args(fmt), **launch_options(),
    )  # fmt: skip
    if bool(bad.any()):
        raise ValueError("x contains inf or NaN; FP8 quantization needs finite inputs")
    return out.reshape(x.shape)
