"""NVFP4 quantization emulated exactly on CPU (``docs/precision.md``, 'NVFP4 arithmetic').

NVFP4 stores 4-bit E2M1 elements (±{0, 0.5, 1, 1.5, 2, 3, 4, 6}) in blocks of 16
along the reduction dimension, one FP8 E4M3 *decode* scale per block, and one FP32
per-tensor amax (NVFP4 paper, arXiv:2509.25149, section 2 and appendix B).
:func:`quantize` reproduces Transformer Engine's arithmetic
(``transformer_engine/common/cast/nvfp4/core_nvfp4.cuh`` and its Python reference
``custom_recipes/reference_nvfp4.py``) in fp32, step by step and in the same order::

    S_enc = min(448*6 / amax, FLT_MAX)        (amax == 0 or S_enc == 0 -> 1)
    S_dec = 1 / S_enc
    s_b   = e4m3_rn_satfinite(block_amax * (S_enc * (1/6)))   # one folded multiply
    enc_b = min(1 / (fp32(s_b) * S_dec), FLT_MAX)            # s_b == 0 -> FLT_MAX
    q     = e2m1_rn_satfinite(x * enc_b)      # or stochastic rounding

Conventions (``docs/precision.md``, 'NVFP4 arithmetic'):

* Codes are sign-magnitude: magnitude index 0..7 for 0, 0.5, ..., 6 and bit 3
  (value 8) for the sign. Two codes per byte, the EVEN element in the LOW nibble.
* Signed zero follows the TE Python reference: its first test is
  ``(x >= 0) & (x <= 0.25)``, so an exact ``-0.0`` gets code 0 while a negative
  value that rounds to zero (``x in [-0.25, 0)`` after scaling) gets code 8 (-0).
  Both decode to 0.
* No lower clamp on the block scale: a zero block, or one whose scale underflows
  E4M3, gets scale byte 0x00 and decodes to 0 (its codes are whatever ``x *
  FLT_MAX`` saturates to, as in TE). E4M3 subnormal scales are used as they come.
* Non-finite input is rejected: no implementation defines a code for it, so it is
  treated as an error.
* Tiles: ``(1, 16)`` for activations/gradients, ``(16, 16)`` for weights
  (``docs/precision.md``, 'NVFP4 tiles'), so quantizing ``W`` or ``W.T`` yields
  the same values, transposed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from factory.kernels.tensor_parts import WHOLE, TensorPart

__all__ = [
    "E2M1_VALUES",
    "NVFP4Tensor",
    "fake_quantize",
    "global_encode_scale",
    "quantize",
    "unpack_codes",
]

#: Decoded value of each 4-bit code 0..15 (code 8 is -0.0), fp32.
E2M1_VALUES = torch.tensor(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    dtype=torch.float32,
)
_F32 = torch.float32
_FLT_MAX = torch.tensor(torch.finfo(_F32).max, dtype=_F32)
_ONE = torch.tensor(1.0, dtype=_F32)
_ONE_SIXTH = torch.tensor(1.0 / 6.0, dtype=_F32)  # the fp32 constant 1.f/6.f
_FP4_X_FP8_MAX = torch.tensor(6.0 * 448.0, dtype=_F32)  # 2688, exact
_BLOCK = 16
_TILES = ((1, 16), (16, 16))


@dataclass(frozen=True)
class NVFP4Tensor:
    """A quantized 2-D tensor.

    ``data``: uint8 [rows, cols/2], two E2M1 codes per byte (even element in the
    low nibble). ``scale``: float8_e4m3fn, one per tile ([rows, cols/16] for 1x16,
    [rows/16, cols/16] for 16x16). ``amax``: fp32 scalar, the global amax.
    """

    data: torch.Tensor
    scale: torch.Tensor
    amax: torch.Tensor
    tile: tuple[int, int]

    @property
    def shape(self) -> tuple[int, int]:
        """Shape of the unquantized tensor."""
        return (self.data.shape[0], self.data.shape[1] * 2)

    def codes(self) -> torch.Tensor:
        """The unpacked 4-bit codes, uint8 [rows, cols]."""
        return unpack_codes(self.data)

    def dequantize(self) -> torch.Tensor:
        """fp32 values ``code_value * fp32(s_b) * (amax / (6*448))`` (TE ``dequantize_fp4``)."""
        values = E2M1_VALUES[self.codes().long()]
        return _decode(values[None], self.scale.to(_F32)[None], self.amax[None], self.tile)[0]


def unpack_codes(data: torch.Tensor) -> torch.Tensor:
    """Split packed bytes [rows, n] into codes [rows, 2n]: low nibble first (even index)."""
    if data.dtype != torch.uint8:
        raise ValueError(f"packed NVFP4 data must be uint8, got {data.dtype}")
    return torch.stack((data & 0x0F, data >> 4), dim=-1).reshape(
        *data.shape[:-1], 2 * data.shape[-1]
    )


def global_encode_scale(amax: torch.Tensor) -> torch.Tensor:
    """``S_enc = min(448*6/amax, FLT_MAX)`` in fp32, with 1.0 when amax or S_enc is 0 (as TE)."""
    amax = amax.to(_F32)
    s_enc = torch.minimum(_FP4_X_FP8_MAX / amax, _FLT_MAX)
    return torch.where((amax == 0) | (s_enc == 0), _ONE, s_enc)


def _tiled(x: torch.Tensor, tile_rows: int) -> torch.Tensor:
    """View [B, rows, cols] as [B, rows/tr, tr, cols/16, 16]: one tile per (dim 1, dim 3) pair."""
    b, rows, cols = x.shape
    return x.reshape(b, rows // tile_rows, tile_rows, cols // _BLOCK, _BLOCK)


def _decode(
    values: torch.Tensor, scale: torch.Tensor, amax: torch.Tensor, tile: tuple[int, int]
) -> torch.Tensor:
    """``values * fp32(s_b) * (amax / (6*448))`` for [B, rows, cols] E2M1 values (TE's order)."""
    per_tile = _tiled(values, tile[0]) * scale[:, :, None, :, None]
    return (per_tile * (amax / _FP4_X_FP8_MAX)[:, None, None, None, None]).reshape(values.shape)


def _grid_step(a: torch.Tensor) -> torch.Tensor:
    """Spacing of the E2M1 grid around magnitude ``a`` in [0, 6]: 0.5 below 2, 1 below 4, else 2."""
    return torch.where(a < 2.0, 0.5, torch.where(a < 4.0, 1.0, 2.0))


def _round_rn(y: torch.Tensor) -> torch.Tensor:
    """E2M1 magnitude of |y| under RN-even with saturation at 6: ties go to the even code.

    Within each binade the grid is uniform, so ``round(a / step) * step`` with
    torch's half-to-even ``round`` lands on the code with the even index:
    0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4; above 5 -> 6.
    Division and multiplication by the power-of-two step are exact.
    """
    a = y.abs().clamp(max=6.0)
    step = _grid_step(a)
    return torch.round(a / step) * step


def _round_sr(
    y: torch.Tensor, generator: torch.Generator | None, part: TensorPart = WHOLE
) -> torch.Tensor:
    """E2M1 magnitude of |y| under stochastic rounding (``docs/precision.md``,
    'Stochastic rounding').

    |y| is clamped to 6, then rounded up to the next grid value with probability
    ``(|y| - lo) / (hi - lo)``, otherwise down to ``lo``, so ``E[q] = clamp(|y|, 0, 6)``.
    At exactly 6 the probability is 0, so nothing rounds past the grid. The random
    numbers are ``part``'s: one process's draws for these elements.
    """
    a = y.abs().clamp(max=6.0)
    step = _grid_step(a)
    units = a / step
    lo = torch.floor(units)
    u = part.uniform(a.shape, generator, a.device)
    return (lo + (u < units - lo).to(_F32)) * step


def _magnitude_codes(mag: torch.Tensor) -> torch.Tensor:
    """Grid magnitude (0, 0.5, ..., 6) -> its 3-bit code 0..7."""
    code = torch.where(mag < 2.0, mag * 2.0, torch.where(mag < 4.0, mag + 2.0, mag * 0.5 + 4.0))
    return code.to(torch.uint8)


def _encode(
    xf: torch.Tensor, tile: tuple[int, int], part: TensorPart = WHOLE
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """TE's scale arithmetic for [B, rows, cols] fp32 with one global amax per matrix: the
    whole matrix's when ``xf`` is a part of it (``part.max``).

    Returns the scaled elements ``y = x * enc_b`` (not yet rounded), the E4M3 block
    scales [B, rows/tr, cols/16] and the fp32 amaxes [B].
    """
    if not bool(torch.isfinite(xf).all()):
        raise ValueError("nvfp4.quantize: input contains non-finite values (NaN or inf)")
    absx = xf.abs()
    amax = part.max(_amax(absx))
    s_enc = global_encode_scale(amax)
    s_dec = _ONE / s_enc
    block_amax = _tiled(absx, tile[0]).amax(dim=(2, 4))
    # One fp32 multiply by the folded constant, then RN-even to E4M3, saturating at 448.
    folded = (s_enc * _ONE_SIXTH)[:, None, None]
    s_b = (block_amax * folded).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    enc_b = torch.minimum(_ONE / (s_b.to(_F32) * s_dec[:, None, None]), _FLT_MAX)
    y = (_tiled(xf, tile[0]) * enc_b[:, :, None, :, None]).reshape(xf.shape)
    return y, s_b, amax


def _amax(absx: torch.Tensor) -> torch.Tensor:
    """The amax of each matrix of [B, rows, cols] absolute values (0 for an empty one)."""
    b = absx.shape[0]
    return absx.reshape(b, -1).amax(dim=1) if absx.numel() else torch.zeros(b, dtype=_F32)


def _check_tile(tile: tuple[int, int]) -> tuple[int, int]:
    tile = (int(tile[0]), int(tile[1]))
    if tile not in _TILES:
        raise ValueError(f"tile must be one of {_TILES}, got {tile}")
    return tile


def quantize(
    x: torch.Tensor,
    tile: tuple[int, int] = (1, 16),
    stochastic: bool = False,
    generator: torch.Generator | None = None,
) -> NVFP4Tensor:
    """Quantize a 2-D tensor to NVFP4 with TE's exact fp32 arithmetic (module docstring).

    ``tile`` is ``(1, 16)`` (one scale per 16 contiguous elements of a row) or
    ``(16, 16)`` (one scale per 16x16 tile, for weights). ``stochastic`` selects
    stochastic rounding of the elements (gradients) with random numbers from
    ``torch.rand(..., generator=generator)``; block scales always use RN.

    Raises ValueError for a non-2-D input, unsupported tile, shape not divisible by
    the tile, or any non-finite element.
    """
    tile = _check_tile(tile)
    if x.ndim != 2:
        raise ValueError(f"quantize expects a 2-D tensor [rows, cols], got shape {tuple(x.shape)}")
    rows, cols = x.shape
    if cols % _BLOCK or rows % tile[0]:
        raise ValueError(
            f"shape {(rows, cols)} must be divisible by the tile {tile} "
            f"(cols by 16{', rows by 16' if tile[0] == 16 else ''})"
        )
    y, s_b, amax = _encode(x.detach().to(_F32)[None], tile)
    y = y[0]
    mag = _magnitude_codes(_round_sr(y, generator) if stochastic else _round_rn(y))
    codes = mag | ((y < 0).to(torch.uint8) << 3)  # exact -0.0 is not < 0 -> code 0
    data = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return NVFP4Tensor(data=data.contiguous(), scale=s_b[0], amax=amax[0].clone(), tile=tile)


def fake_quantize(
    x: torch.Tensor,
    tile: tuple[int, int] = (1, 16),
    stochastic: bool = False,
    generator: torch.Generator | None = None,
    part: TensorPart = WHOLE,
) -> torch.Tensor:
    """``quantize(x).dequantize()`` without packing, for the emulated GEMMs: fp32, x's shape.

    Two differences from :func:`quantize`, both for GEMM operands:

    * ``x`` may have leading batch dims ``[..., rows, cols]``; every matrix gets
      its own global amax (one per expert in a grouped GEMM).
    * Shapes need not be whole tiles: rows and cols are zero-padded to the tile
      and cropped after. Zeros never change an amax, so every complete tile
      quantizes exactly as :func:`quantize` would, and a partial tile as if the
      kernel had padded it.

    The values equal ``quantize(m, tile, ...).dequantize()`` of each matrix ``m``
    bit for bit (given the same random numbers when ``stochastic``), except that
    an exact ``-0.0`` input stays ``-0.0`` where :func:`quantize`'s code 0
    decodes to ``+0.0``; the two compare equal.

    ``part`` says whose amax and random numbers these are: ``x`` may be a part of
    a tensor split over processes (``factory.kernels.tensor_parts``).
    """
    tile = _check_tile(tile)
    if x.ndim < 2:
        raise ValueError(f"fake_quantize expects [..., rows, cols], got shape {tuple(x.shape)}")
    *lead, rows, cols = x.shape
    xf = x.detach().to(_F32).reshape(math.prod(lead), rows, cols)  # -1 is ambiguous if empty
    if x.numel() == 0:  # e.g. an expert that got no tokens; its part still joins the amax
        part.max(_amax(xf))
        return torch.zeros(x.shape, dtype=_F32)
    pad_rows, pad_cols = -rows % tile[0], -cols % _BLOCK
    if pad_rows or pad_cols:
        xf = torch.nn.functional.pad(xf, (0, pad_cols, 0, pad_rows))
    y, s_b, amax = _encode(xf, tile, part)
    mag = _round_sr(y, generator, part) if stochastic else _round_rn(y)
    values = mag.copysign(y)
    out = _decode(values, s_b.to(_F32), amax, tile)
    return out[:, :rows, :cols].reshape(*lead, rows, cols)
