"""What the Triton quantizers share: loading a tile, its 16x16 rotation, the per-matrix amax,
and exact fp32 rounding done with integer operations.

Every rounding to a narrower float format (BF16, E4M3, E5M2) is written here with
bit operations on the fp32 pattern instead of Triton's casts, so the Triton
interpreter (numpy, ``TRITON_INTERPRET=1``) and compiled GPU code compute the
same bits by construction, and both match ``torch``'s round-to-nearest-even
casts that the PyTorch emulation (``factory.kernels.nvfp4``, ``factory.kernels.fp8``)
uses. Kernels are launched with ``enable_fp_fusion=False``: a multiply followed
by an add must not become one FMA, which rounds once instead of twice.

Tiles are viewed as 4-D ``[RT, TR, NB, 16]`` blocks of a ``[B, R, C]`` tensor
(``RT`` groups of ``TR`` rows, ``NB`` runs of 16 columns): one quantization block
is a ``(TR, 16)`` slice. Positions past ``R`` or ``C`` load as zeros, which is
the emulation's zero padding.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from factory.kernels import hadamard

__all__ = [
    "FLT_MAX",
    "launch_options",
    "load_tile",
    "program_tile",
    "rne_drop_bits",
    "rotation_matrix",
    "round_to_bf16",
    "round_to_fp8",
    "tile_amax",
    "tile_grid",
    "tile_indices",
    "with_sign_of",
]

FLT_MAX = tl.constexpr(3.4028234663852886e38)
"""The largest finite fp32, a constant the kernels can read."""
_RUN = 16


def launch_options() -> dict[str, bool]:
    """Keyword arguments of every launch: no mul+add fusion (see the module docstring)."""
    return {"enable_fp_fusion": False}


def rotation_matrix(signs: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``diag(signs) @ H_16`` as fp32 [16, 16] on ``device``: the matrix ``hadamard.rht``
    right-multiplies each run of 16 elements by. Built once per sign vector and device
    (every wgrad operand asks for it)."""
    values = tuple(float(s) for s in signs.reshape(-1).tolist())
    if len(values) != _RUN or any(abs(s) != 1 for s in values):
        raise ValueError(f"signs must be {_RUN} values of ±1")
    return _rotation(values, str(torch.device(device)))


@functools.lru_cache(maxsize=16)
def _rotation(signs: tuple[float, ...], device: str) -> torch.Tensor:
    vector = torch.tensor(signs, dtype=torch.float32)
    return (vector[:, None] * hadamard.hadamard_matrix(_RUN)).contiguous().to(device)


@triton.jit
def rne_drop_bits(bits, DROP: tl.constexpr):
    """Round the bit pattern of a non-negative fp32 to ``23 - DROP`` mantissa bits, ties to
    even. A carry into the exponent is the right result (1.96875 -> 2.0), and the largest
    finite values round to the infinity pattern, as a cast does."""
    return (bits + ((1 << (DROP - 1)) - 1) + ((bits >> DROP) & 1)) & (-(1 << DROP))


@triton.jit
def round_to_bf16(v):
    """fp32 -> the nearest BF16 value (ties to even), still held in fp32."""
    bits = v.to(tl.int32, bitcast=True)
    mag = rne_drop_bits(bits & 0x7FFFFFFF, 16)
    return (mag | (bits & -2147483648)).to(tl.float32, bitcast=True)


@triton.jit
def with_sign_of(magnitude, signed):
    """A non-negative fp32 ``magnitude`` with the sign bit of ``signed`` (-0.0 included), set
    in the bit pattern: ``-x`` compiles to ``neg.f32``, which on an H100 gave +0.0 for a
    zero where the interpreter and the emulation give -0.0."""
    sign = signed.to(tl.int32, bitcast=True) & -2147483648
    return (magnitude.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def round_to_fp8(
    v,
    MANT: tl.constexpr,
    MIN_NORMAL: tl.constexpr,
    MAGIC: tl.constexpr,
    MAX: tl.constexpr,
):
    """A non-negative fp32 -> the nearest value of an FP8 grid (ties to even), saturating at
    ``MAX``: ``clamp(v, max=MAX).to(float8)`` in torch.

    Normal values keep ``MANT`` mantissa bits by integer rounding of the pattern.
    Below ``MIN_NORMAL`` the grid is uniform with spacing ``2**(emin - MANT)``, and
    ``(v + MAGIC) - MAGIC`` with ``MAGIC = 2**(emin - MANT + 23)`` rounds to it: the
    sum's last mantissa bit is worth exactly that spacing.
    """
    v = tl.minimum(v, MAX)
    normal = rne_drop_bits(v.to(tl.int32, bitcast=True), 23 - MANT).to(tl.float32, bitcast=True)
    subnormal = (v + MAGIC) - MAGIC
    return tl.where(v < MIN_NORMAL, subnormal, normal)


@triton.jit
def tile_indices(row0, col0, RT: tl.constexpr, TR: tl.constexpr, NB: tl.constexpr):
    """The rows ``[RT, TR, 1, 1]`` of the tile at (``row0``, ``col0``) and the first column of
    each of its runs of 16 ``[1, 1, NB, 1]``."""
    rows = row0 + tl.arange(0, RT)[:, None, None, None] * TR + tl.arange(0, TR)[None, :, None, None]
    return rows, col0 + tl.arange(0, NB)[None, None, :, None] * 16


@triton.jit
def load_tile(
    x_ptr, b, row0, col0, R, C, sb, sr, sc, m_ptr,
    RT: tl.constexpr, TR: tl.constexpr, NB: tl.constexpr,
    ROTATE: tl.constexpr, ROUND_BF16: tl.constexpr,
):  # fmt: skip
    """The fp32 tile ``[RT, TR, NB, 16]`` of matrix ``b`` at (``row0``, ``col0``), zeros past
    the edges. With ``ROTATE`` each run of 16 columns is right-multiplied by the
    16x16 matrix at ``m_ptr``, summing ``x_k * m[k, j]`` for k = 0..15 in that order
    (the order the tests' reference uses); ``ROUND_BF16`` then rounds the result to
    BF16, as ``hadamard.rht`` does for a BF16 input."""
    rows, run = tile_indices(row0, col0, RT, TR, NB)
    c2 = tl.arange(0, 16)[None, None, None, :]
    base = x_ptr + b.to(tl.int64) * sb + rows.to(tl.int64) * sr
    if ROTATE:
        x = tl.load(base + run * sc, mask=(rows < R) & (run < C), other=0.0).to(tl.float32)
        acc = x * tl.load(m_ptr + c2)
        for k in tl.static_range(1, 16):
            mask = (rows < R) & (run + k < C)
            x = tl.load(base + (run + k) * sc, mask=mask, other=0.0).to(tl.float32)
            acc = acc + x * tl.load(m_ptr + k * 16 + c2)
        if ROUND_BF16:
            acc = round_to_bf16(acc)
        return acc
    cols = run + c2
    return tl.load(base + cols * sc, mask=(rows < R) & (cols < C), other=0.0).to(tl.float32)


@triton.jit
def program_tile(
    x_ptr, R, C, sb, sr, sc, m_ptr,
    RT: tl.constexpr, TR: tl.constexpr, NB: tl.constexpr,
    ROTATE: tl.constexpr, ROUND_BF16: tl.constexpr,
):  # fmt: skip
    """This program's tile on a :func:`tile_grid` launch: (its matrix ``b``, first row, first
    column, the fp32 tile :func:`load_tile` reads there)."""
    pid = tl.program_id(0)
    b = tl.program_id(1)
    npc = tl.cdiv(C, NB * 16)
    row0 = (pid // npc) * (RT * TR)
    col0 = (pid % npc) * (NB * 16)
    x = load_tile(x_ptr, b, row0, col0, R, C, sb, sr, sc, m_ptr, RT, TR, NB, ROTATE, ROUND_BF16)
    return b, row0, col0, x


@triton.jit
def _amax_kernel(
    x_ptr, R, C, sb, sr, sc,  # the input [B, R, C] and its strides
    m_ptr,  # the 16x16 rotation, read with ROTATE
    amax_ptr, bad_ptr,  # the outputs, one slot per program
    RT: tl.constexpr, TR: tl.constexpr, NB: tl.constexpr,
    ROTATE: tl.constexpr, ROUND_BF16: tl.constexpr,
):  # fmt: skip
    """One tile's max |x| and count of non-finite elements, stored at its program's slot."""
    b, _, _, x = program_tile(x_ptr, R, C, sb, sr, sc, m_ptr, RT, TR, NB, ROTATE, ROUND_BF16)
    a = tl.reshape(tl.abs(x), [RT * TR * NB * 16])
    bad = ((a != a) | (a == float("inf"))).to(tl.int32)
    slot = b.to(tl.int64) * tl.num_programs(0) + tl.program_id(0)
    tl.store(amax_ptr + slot, tl.max(a, axis=0))
    tl.store(bad_ptr + slot, tl.sum(bad, axis=0))


def tile_grid(
    rows: int, cols: int, block_rows: int, block_cols: int, batch: int
) -> tuple[int, int]:
    """Programs over ``[batch, rows, cols]``: row-tile x column-tile on axis 0, matrix on 1."""
    return (triton.cdiv(rows, block_rows) * triton.cdiv(cols, block_cols), batch)


def tile_amax(
    x3: torch.Tensor,
    tile_rows: int = 1,
    rotation: torch.Tensor | None = None,
    who: str = "quantize",
) -> torch.Tensor:
    """fp32 [B]: the max |x| of each matrix of ``x3 [B, R, C]`` (after the rotation when given,
    rounded to BF16 when ``x3`` is BF16). Raises ValueError when an element is non-finite:
    this synchronizes with the device, as the emulation's check does."""
    b, rows, cols = x3.shape
    rt, nb = max(1, 32 // tile_rows), 4
    grid = tile_grid(rows, cols, rt * tile_rows, nb * 16, b)
    partial = torch.empty(grid[0] * b, dtype=torch.float32, device=x3.device)
    bad = torch.empty(grid[0] * b, dtype=torch.int32, device=x3.device)
    rotate = rotation is not None
    _amax_kernel[grid](
        x3,
        rows,
        cols,
        *x3.stride(),
        rotation if rotate else x3,
        partial,
        bad,
        RT=rt,
        TR=tile_rows,
        NB=nb,
        ROTATE=rotate,
        ROUND_BF16=rotate and x3.dtype == torch.bfloat16,
        **launch_options(),
    )
    if bool(bad.any()):
        raise ValueError(f"{who}: input contains non-finite values (NaN or inf)")
    return partial.reshape(b, -1).amax(dim=1)
