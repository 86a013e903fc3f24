"""NVFP4 quantize and fake-quantize as Triton kernels, bit-exact with ``factory.kernels.nvfp4``.

Each program quantizes one tile of whole blocks in one pass: load (optionally
rotating each run of 16 columns by the 16x16 random Hadamard matrix), the E4M3
block scales, the E2M1 elements (round-to-nearest-even, or stochastic rounding
with given uniform numbers), then either the packed codes and scale bytes
(:func:`quantize`) or the dequantized values (:func:`fake_quantize`). The
global amax is a separate reduction (``triton_tiles.tile_amax``) unless given,
as it is for a tensor split over ranks.

The arithmetic is the emulation's, operation for operation, in fp32 (see its
docstring; ``docs/precision.md``, 'NVFP4 arithmetic')::

    S_enc = min(2688 / amax, FLT_MAX)  (1 if amax or S_enc is 0);  S_dec = 1 / S_enc
    s_b   = e4m3_rn_satfinite(block_amax * (S_enc * fp32(1/6)))
    enc_b = min(1 / (s_b * S_dec), FLT_MAX);  y = x * enc_b
    out   = (e2m1(y) * s_b) * (amax / 2688)

Divisions are ``div_rn`` (IEEE, never the approximate form), roundings are
integer operations (``triton_tiles``), and E2M1 rounding is a count of
threshold comparisons, so no instruction's rounding mode is left to the
compiler. Given the same uniforms, stochastic rounding makes the same choices
as the emulation: a value goes up when ``u < (|y| - lo) / step``.

The 16x16 rotation sums ``x_k * m[k, j]`` in a fixed order (k = 0..15); the
emulation's ``hadamard.rht`` is a matrix product whose summation order is
the BLAS library's. Both give the same bits whenever the 16-term sums are exact in
fp32, and otherwise may differ in the last bit of a rotated value.

Compiled for sm_90, every fp32 add, multiply and divide is IEEE round-to-nearest
with subnormals kept (no FMA, no ``.ftz``; ``tests/test_kernels_triton.py`` reads
the PTX; no ``neg.f32``, which gave +0.0 for -0.0 on an H100). ``python -m benchmarks
gpu`` checks a compiled run's bits and speed on the device (``BENCHMARKS.md``, gpu).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from factory.kernels import nvfp4
from factory.kernels.triton_tiles import (
    FLT_MAX,
    launch_options,
    load_tile,
    program_tile,
    rotation_matrix,
    round_to_bf16,
    round_to_fp8,
    tile_amax,
    tile_grid,
    tile_indices,
    with_sign_of,
)

__all__ = ["fake_quantize", "global_amax", "quantize"]

_ONE_SIXTH = tl.constexpr(1.0 / 6.0)  # the kernel rounds it to fp32: TE's 1.f/6.f
_BLOCK_ROWS, _BLOCK_COLS = 32, 128  # the fastest of benchmarks.gpu_kernels.GEOMETRIES on an H100


@triton.jit
def _e2m1(y, u, STOCHASTIC: tl.constexpr):
    """Magnitude code 0..7 of |y| clamped to 6. RN: ties to the even code (0.25 -> 0,
    0.75 -> 1.0, 1.25 -> 1.0, 1.75 -> 2.0, 2.5 -> 2.0, 3.5 -> 4.0, 5 -> 4.0). SR: the
    grid value below, plus one when ``u < (|y| - lo) / step``."""
    a = tl.minimum(tl.abs(y), 6.0)
    if STOCHASTIC:
        lo = (
            (a >= 0.5).to(tl.int32)
            + (a >= 1.0).to(tl.int32)
            + (a >= 1.5).to(tl.int32)
            + (a >= 2.0).to(tl.int32)
            + (a >= 3.0).to(tl.int32)
            + (a >= 4.0).to(tl.int32)
            + (a >= 6.0).to(tl.int32)
        )
        inv_step = tl.where(a < 2.0, 2.0, tl.where(a < 4.0, 1.0, 0.5))
        return lo + (u < (a - _e2m1_value(lo)) * inv_step).to(tl.int32)
    return (
        (a > 0.25).to(tl.int32)
        + (a >= 0.75).to(tl.int32)
        + (a > 1.25).to(tl.int32)
        + (a >= 1.75).to(tl.int32)
        + (a > 2.5).to(tl.int32)
        + (a >= 3.5).to(tl.int32)
        + (a > 5.0).to(tl.int32)
    )


@triton.jit
def _e2m1_nearest(y):
    """The E2M1 grid value nearest |y| clamped to 6, ties to even: the values of
    ``_e2m1_value(_e2m1(y, 0, False))`` (equal for every fp32 in [0, 6], checked
    exhaustively), in a third of the instructions. E2M1 is a float with one mantissa bit,
    normal from 1 and 0.5 apart below, so FP8's rounding serves with its constants:
    ``2**22`` makes the sum's last bit worth 0.5. The RN paths run this: with the
    comparisons the fake-quant kernel ran at 37% of an H100's HBM bandwidth, with this at
    46-49% (``BENCHMARKS.md``, gpu)."""
    return round_to_fp8(tl.abs(y), 1, 1.0, 4194304.0, 6.0)


@triton.jit
def _e2m1_code(magnitude):
    """Grid magnitude (0, 0.5, ..., 6) -> its 3-bit code 0..7 (exact: small integers)."""
    twice = magnitude * 2.0
    code = tl.where(
        magnitude < 2.0, twice, tl.where(magnitude < 4.0, magnitude + 2.0, twice * 0.25 + 4.0)
    )
    return code.to(tl.int32)


@triton.jit
def _e2m1_value(code):
    """Magnitude of code 0..7: 0, 0.5, 1, 1.5, 2, 3, 4, 6 (fp32)."""
    c = code.to(tl.float32)
    return tl.where(code < 4, c * 0.5, tl.where(code < 6, c - 2.0, (c - 4.0) * 2.0))


@triton.jit
def _block_scales(x, amax):
    """TE's scale chain for one tile: the E4M3 scales [RT, NB] (as fp32 values) and the
    elements times their block's encode scale, ``y = x * enc_b``, not yet rounded."""
    s_enc = tl.minimum(tl.div_rn(tl.full([], 2688.0, tl.float32), amax), FLT_MAX)
    s_enc = tl.where((amax == 0.0) | (s_enc == 0.0), 1.0, s_enc)
    s_dec = tl.div_rn(tl.full([], 1.0, tl.float32), s_enc)
    block_amax = tl.max(tl.max(tl.abs(x), axis=3), axis=1)
    s_b = round_to_fp8(block_amax * (s_enc * _ONE_SIXTH), 3, 0.015625, 16384.0, 448.0)
    enc = tl.minimum(tl.div_rn(tl.full(s_b.shape, 1.0, tl.float32), s_b * s_dec), FLT_MAX)
    return s_b, x * enc[:, None, :, None]


@triton.jit
def _fake_kernel(
    x_ptr, R, C, sb, sr, sc,  # the input [B, R, C] and its strides
    amax_ptr,  # fp32 [B]
    u_ptr, usb, usr, usc,  # the uniforms, read with STOCHASTIC
    m_ptr,  # the 16x16 rotation, read with ROTATE
    out_ptr, osb, osr, osc,  # the output [B, R, C]
    RT: tl.constexpr, TR: tl.constexpr, NB: tl.constexpr,
    ROTATE: tl.constexpr, ROUND_BF16: tl.constexpr, STOCHASTIC: tl.constexpr,
    OUT_BF16: tl.constexpr,
):  # fmt: skip
    b, row0, col0, x = program_tile(x_ptr, R, C, sb, sr, sc, m_ptr, RT, TR, NB, ROTATE, ROUND_BF16)
    amax = tl.load(amax_ptr + b)
    s_b, y = _block_scales(x, amax)
    u = 0.0
    if STOCHASTIC:  # padding reads 0, and its y is 0, which never rounds up either way
        u = load_tile(u_ptr, b, row0, col0, R, C, usb, usr, usc, m_ptr, RT, TR, NB, False, False)
    magnitude = _e2m1_value(_e2m1(y, u, STOCHASTIC)) if STOCHASTIC else _e2m1_nearest(y)
    value = (magnitude * s_b[:, None, :, None]) * tl.div_rn(amax, tl.full([], 2688.0, tl.float32))
    value = with_sign_of(value, y)
    rows, runs = tile_indices(row0, col0, RT, TR, NB)
    cols = runs + tl.arange(0, 16)[None, None, None, :]
    ptr = out_ptr + b.to(tl.int64) * osb + rows.to(tl.int64) * osr + cols * osc
    mask = (rows < R) & (cols < C)
    if OUT_BF16:
        bits = round_to_bf16(value).to(tl.int32, bitcast=True) >> 16
        tl.store(ptr, bits.to(tl.int16), mask=mask)
    else:
        tl.store(ptr, value, mask=mask)


@triton.jit
def _pack_kernel(
    x_ptr, R, C, sb, sr, sc,  # the input [1, R, C] and its strides
    amax_ptr,  # fp32 [1]
    u_ptr, usb, usr, usc,  # the uniforms, read with STOCHASTIC
    m_ptr,  # the 16x16 rotation, read with ROTATE
    data_ptr, scale_ptr,  # the outputs, contiguous
    RT: tl.constexpr, TR: tl.constexpr, NB: tl.constexpr,
    ROTATE: tl.constexpr, ROUND_BF16: tl.constexpr, STOCHASTIC: tl.constexpr,
):  # fmt: skip
    """Codes packed two per byte (even element in the low nibble) into ``data [R, C/2]`` and
    E4M3 scale bytes into ``scale [R/TR, C/16]``; R and C are whole tiles."""
    b, row0, col0, x = program_tile(x_ptr, R, C, sb, sr, sc, m_ptr, RT, TR, NB, ROTATE, ROUND_BF16)
    s_b, y = _block_scales(x, tl.load(amax_ptr + b))
    u = 0.0
    if STOCHASTIC:
        u = load_tile(u_ptr, b, row0, col0, R, C, usb, usr, usc, m_ptr, RT, TR, NB, False, False)
    magnitude_codes = _e2m1(y, u, STOCHASTIC) if STOCHASTIC else _e2m1_code(_e2m1_nearest(y))
    codes = magnitude_codes | tl.where(y < 0.0, 8, 0)  # exact -0.0 keeps code 0
    pairs = tl.reshape(codes, [RT * TR, NB * 8, 2])
    packed = tl.sum(pairs * (1 + 15 * tl.arange(0, 2))[None, None, :], axis=2)
    rows = row0 + tl.arange(0, RT * TR)[:, None]
    byte_cols = col0 // 2 + tl.arange(0, NB * 8)[None, :]
    tl.store(data_ptr + rows.to(tl.int64) * (C // 2) + byte_cols, packed.to(tl.uint8),
             mask=(rows < R) & (byte_cols < C // 2))  # fmt: skip
    s_bits = s_b.to(tl.int32, bitcast=True)
    normal = (((s_bits >> 23) - 120) << 3) | ((s_bits >> 20) & 7)
    s_byte = tl.where(s_b < 0.015625, (s_b * 512.0).to(tl.int32), normal)
    srow = row0 // TR + tl.arange(0, RT)[:, None]
    scol = col0 // 16 + tl.arange(0, NB)[None, :]
    tl.store(scale_ptr + srow.to(tl.int64) * (C // 16) + scol, s_byte.to(tl.uint8),
             mask=(srow < R // TR) & (scol < C // 16))  # fmt: skip


def _as_batch(x: torch.Tensor) -> torch.Tensor:
    """``[..., rows, cols]`` as ``[B, rows, cols]``, a view where the strides allow."""
    return x.reshape(-1, *x.shape[-2:])


def global_amax(
    x: torch.Tensor, tile: tuple[int, int] = (1, 16), rht_signs: torch.Tensor | None = None
) -> torch.Tensor:
    """fp32 [B]: the amax of each matrix of ``x [..., rows, cols]`` (after the rotation when
    ``rht_signs`` is given); what a split tensor's parts all-reduce (max) before
    :func:`fake_quantize`. Raises ValueError for a non-finite element."""
    rotation = None if rht_signs is None else rotation_matrix(rht_signs, x.device)
    return tile_amax(_as_batch(x), tile[0], rotation, "nvfp4.quantize")


def _amax_for(
    x3: torch.Tensor,
    tile: tuple[int, int],
    amax: torch.Tensor | None,
    rotation: torch.Tensor | None,
) -> torch.Tensor:
    """Each matrix's amax: the given one (checked), or measured by the amax kernel."""
    if amax is None:
        return tile_amax(x3, tile[0], rotation, "nvfp4.quantize")
    amax = amax.to(device=x3.device, dtype=torch.float32).reshape(-1)
    if amax.numel() == 1 and x3.shape[0] > 1:
        amax = amax.expand(x3.shape[0])
    if amax.shape != (x3.shape[0],) or not bool(torch.isfinite(amax).all()):
        raise ValueError(f"amax must be finite, one per matrix ({x3.shape[0]}), got {amax}")
    return amax.contiguous()


class _Launch(NamedTuple):
    """What both kernels take, worked out once for ``x3 [B, rows, cols]``."""

    grid: tuple[int, int]
    operands: list
    """The input and its strides, the amaxes, the uniforms and their strides (the input's
    where there are none, never read), the rotation (likewise)."""
    constexprs: dict
    amax: torch.Tensor
    """fp32 [B]: the amax of each matrix."""


def _launch(
    x3: torch.Tensor,
    tile: tuple[int, int],
    amax: torch.Tensor | None,
    uniform: torch.Tensor | None,
    rht_signs: torch.Tensor | None,
) -> _Launch:
    b, rows, cols = x3.shape
    rotation = None if rht_signs is None else rotation_matrix(rht_signs, x3.device)
    amax = _amax_for(x3, tile, amax, rotation)
    padded = (b, rows + -rows % tile[0], cols + -cols % 16)
    u3 = x3 if uniform is None else _uniforms(uniform, padded, x3.device)
    rt, nb = max(1, _BLOCK_ROWS // tile[0]), _BLOCK_COLS // 16
    operands = [
        x3, rows, cols, *x3.stride(), amax, u3, *u3.stride(),
        x3 if rotation is None else rotation,
    ]  # fmt: skip
    constexprs = {
        "RT": rt, "TR": tile[0], "NB": nb, "ROTATE": rotation is not None,
        "ROUND_BF16": rotation is not None and x3.dtype == torch.bfloat16,
        "STOCHASTIC": uniform is not None, **launch_options(),
    }  # fmt: skip
    return _Launch(tile_grid(rows, cols, rt * tile[0], nb * 16, b), operands, constexprs, amax)


def fake_quantize(
    x: torch.Tensor,
    tile: tuple[int, int] = (1, 16),
    *,
    amax: torch.Tensor | None = None,
    uniform: torch.Tensor | None = None,
    rht_signs: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``nvfp4.fake_quantize`` in one kernel: the dequantized values of ``x [..., rows, cols]``
    as ``out_dtype`` (fp32 or bf16), each matrix with its own global amax.

    ``amax``: fp32 [B] (or one value for all) to use instead of each matrix's own,
    e.g. the all-reduced amax of a split tensor. ``uniform``: U[0, 1) numbers of
    the zero-padded shape ``[B, rows_pad, cols_pad]`` (what the emulation draws
    with its generator); given, the elements use stochastic rounding. ``rht_signs``:
    rotate each run of 16 columns by ``diag(signs) @ H_16`` first (zero-padded).
    Partial tiles are zero-padded as in the emulation; a non-finite element
    raises ValueError. The input is not checked for finiteness when ``amax`` is given.
    """
    tile = nvfp4._check_tile(tile)
    if x.ndim < 2 or x.numel() == 0:
        raise ValueError(f"fake_quantize expects a non-empty [..., rows, cols], got {x.shape}")
    if out_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"out_dtype must be float32 or bfloat16, got {out_dtype}")
    x3 = _as_batch(x)
    launch = _launch(x3, tile, amax, uniform, rht_signs)
    out = torch.empty(x3.shape, dtype=out_dtype, device=x.device)
    o3 = out.view(torch.int16) if out_dtype == torch.bfloat16 else out
    _fake_kernel[launch.grid](
        *launch.operands, o3, *o3.stride(),
        OUT_BF16=out_dtype == torch.bfloat16, **launch.constexprs,
    )  # fmt: skip
    return out.reshape(x.shape)


def _uniforms(
    uniform: torch.Tensor, padded: tuple[int, int, int], device: torch.device
) -> torch.Tensor:
    """The stochastic-rounding numbers as fp32 [B, rows_pad, cols_pad] on ``device``."""
    u3 = uniform.to(device=device, dtype=torch.float32).reshape(-1, *uniform.shape[-2:])
    if tuple(u3.shape) != padded:
        raise ValueError(f"uniform must have the padded shape {padded}, got {uniform.shape}")
    return u3


def quantize(
    x: torch.Tensor,
    tile: tuple[int, int] = (1, 16),
    *,
    amax: torch.Tensor | None = None,
    uniform: torch.Tensor | None = None,
    rht_signs: torch.Tensor | None = None,
) -> nvfp4.NVFP4Tensor:
    """``nvfp4.quantize`` in one kernel: packed codes, E4M3 scales and the amax of a 2-D
    ``x`` whose shape is whole tiles. ``amax``, ``uniform`` (shape ``[rows, cols]``) and
    ``rht_signs`` as in :func:`fake_quantize`."""
    tile = nvfp4._check_tile(tile)
    if x.ndim != 2:
        raise ValueError(f"quantize expects a 2-D tensor [rows, cols], got shape {tuple(x.shape)}")
    rows, cols = x.shape
    if cols % 16 or rows % tile[0] or x.numel() == 0:
        raise ValueError(f"shape {(rows, cols)} must be non-empty whole tiles {tile}")
    launch = _launch(x[None], tile, amax, uniform, rht_signs)
    data = torch.empty((rows, cols // 2), dtype=torch.uint8, device=x.device)
    scale = torch.empty((rows // tile[0], cols // 16), dtype=torch.uint8, device=x.device)
    _pack_kernel[launch.grid](*launch.operands, data, scale, **launch.constexprs)
    return nvfp4.NVFP4Tensor(data, scale.view(torch.float8_e4m3fn), launch.amax[0].clone(), tile)
