"""NVFP4 quantization: exact codes and scales (``docs/precision.md``, 'NVFP4 arithmetic'),
error bound, SR, 2D tiles."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from factory.kernels.nvfp4 import E2M1_VALUES, quantize, unpack_codes

F32 = np.float32
GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=F32)


def e4m3_rn(v: float) -> float:
    """Independent RN-even cast of a non-negative fp32 value to E4M3 (max 448, subnormal step 2^-9)."""
    v = min(float(v), 448.0)
    step = 2.0**-9 if v < 2.0**-6 else 2.0 ** (np.floor(np.log2(v)) - 3)
    return min(float(np.round(v / step)) * step, 448.0)  # v/step exact; np.round is half-even


def e2m1_rn_index(a: float) -> int:
    """Nearest grid magnitude to min(a, 6), ties to the even index (independent of the kernel)."""
    a = min(a, 6.0)
    d = np.abs(GRID - a)
    best = np.flatnonzero(d == d.min())
    return int(best[0] if len(best) == 1 or best[0] % 2 == 0 else best[1])


def reference_1x16(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Scalar transcription of TE's NVFP4 arithmetic in numpy float32 (``docs/precision.md``,
    'NVFP4 arithmetic'): (codes [r, c], scales [r, c/16])."""
    x = x.astype(F32)
    amax = F32(np.abs(x).max())
    s_enc = F32(1.0) if amax == 0 else min(F32(2688.0) / amax, F32(np.finfo(F32).max))
    s_dec = F32(1.0) / s_enc
    rows, cols = x.shape
    codes = np.zeros(x.shape, dtype=np.uint8)
    scales = np.zeros((rows, cols // 16), dtype=F32)
    folded = s_enc * F32(1.0 / 6.0)
    for r in range(rows):
        for b in range(cols // 16):
            blk = x[r, 16 * b : 16 * b + 16]
            s_b = F32(e4m3_rn(F32(np.abs(blk).max()) * folded))
            scales[r, b] = s_b
            enc = (
                np.finfo(F32).max if s_b == 0 else min(F32(1.0) / (s_b * s_dec), np.finfo(F32).max)
            )
            for i, v in enumerate(blk):
                y = F32(v) * F32(enc)
                codes[r, 16 * b + i] = e2m1_rn_index(abs(float(y))) | (8 if y < 0 else 0)
    return codes, scales


def row(values: list[float], fill: float = 0.0) -> torch.Tensor:
    """A [1, 16] fp32 tensor starting with ``values``, padded with ``fill``."""
    return torch.tensor([[*values] + [fill] * (16 - len(values))], dtype=torch.float32)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_scalar_reference_wide_range(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(8, 64, generator=gen) * torch.exp(3 * torch.randn(8, 1, generator=gen))
    x[0, :16] = 0.0  # one zero block
    q = quantize(x)
    codes, scales = reference_1x16(x.numpy())
    assert np.array_equal(q.scale.float().numpy(), scales)
    assert np.array_equal(q.codes().numpy(), codes)


@pytest.mark.parametrize("k", [1.0, 0.125, 32.0])
def test_ties_round_to_even_code(k: float) -> None:
    # Block amax 6k in a tensor of amax 6k: S_enc = 448/k, s_b = 448, enc_b = 1/k exactly.
    mids = [6, 5, 3.5, 2.5, 1.75, 1.25, 0.75, 0.25, -5, -3.5, -2.5, -1.75, -1.25, -0.75, -0.25]
    q = quantize(row(mids) * k)
    assert q.scale.float().item() == 448.0
    expect = [7, 6, 6, 4, 4, 2, 2, 0, 14, 14, 12, 12, 10, 10, 8, 0]
    assert q.codes()[0].tolist() == expect
    # Dequantize is TE's q * s_b * (amax / 2688); amax/2688 is not exact, so allow an ulp or two.
    exact = torch.tensor([6 * k, 4 * k, 4 * k, 2 * k, 2 * k, k, k, 0.0])
    torch.testing.assert_close(q.dequantize()[0, :8], exact, rtol=2**-22, atol=0)
    formula = E2M1_VALUES[q.codes().long()] * 448.0 * (q.amax / 2688.0)
    assert torch.equal(q.dequantize(), formula)


def test_off_tie_values_and_grid_points() -> None:
    vals = [6, 0.26, 0.74, 1.26, 1.74, 2.49, 2.51, 3.49, 5.01, 4.99, 0.5, 1.5, 3.0, 4.0, 2.0, 1.0]
    q = quantize(row(vals))
    assert q.codes()[0].tolist() == [7, 1, 1, 3, 3, 4, 5, 5, 7, 6, 1, 3, 5, 6, 4, 2]


def test_zero_block_and_all_zero_tensor() -> None:
    x = torch.cat([row([6.0, 1.0]), row([])], dim=1)
    q = quantize(x)
    assert q.scale.view(torch.uint8)[0, 1].item() == 0
    assert q.codes()[0, 16:].eq(0).all()
    z = quantize(torch.zeros(16, 32), tile=(16, 16))
    assert z.amax.item() == 0.0 and z.amax.dtype == torch.float32
    assert z.scale.view(torch.uint8).eq(0).all() and z.data.eq(0).all()
    assert z.dequantize().eq(0).all()


def test_subnormal_and_underflowing_block_scales() -> None:
    # Global amax 2688 -> S_enc = 1, so s_b = RN_e4m3(block_amax / 6).
    huge = row([2688.0])
    tiny = row([6 * 2.0**-8, 3 * 2.0**-8, -(2.0**-9)])  # s_b = 2^-8, an E4M3 subnormal (2 * 2^-9)
    gone = row([6 * 2.0**-11, -3 * 2.0**-11])  # s_b = 2^-11 < 2^-10: underflows to 0
    q = quantize(torch.cat([huge, tiny, gone], dim=1))
    assert q.scale.view(torch.uint8)[0].tolist() == [0x7E, 0x02, 0x00]  # 448, 2^-8, 0
    assert q.codes()[0, 16:19].tolist() == [7, 5, 9]
    deq = q.dequantize()[0]
    assert deq[16:19].tolist() == [6 * 2.0**-8, 3 * 2.0**-8, -(2.0**-9)]
    # TE arithmetic: enc_b = FLT_MAX, so x * enc_b saturates the codes, but scale 0 decodes to 0.
    assert q.codes()[0, 32:34].tolist() == [7, 15]
    assert deq[32:].eq(0).all()


def test_saturation_when_block_scale_rounds_down() -> None:
    # S_enc = 1; block amax 6.36 -> s_b = RN_e4m3(1.06) = 1.0, so y = 6.36 and 5.5 both -> 6.
    q = quantize(torch.cat([row([2688.0]), row([6.36, -5.5, 5.0])], dim=1))
    assert q.scale.float()[0].tolist() == [448.0, 1.0]
    assert q.codes()[0, 16:19].tolist() == [7, 15, 6]
    assert q.dequantize()[0, 16:19].tolist() == [6.0, -6.0, 4.0]


def test_global_amax_block_gets_scale_448_and_code_6() -> None:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(4, 48, generator=gen)
    q = quantize(x)
    r, c = divmod(int(x.abs().argmax()), 48)
    assert q.scale.float()[r, c // 16].item() == 448.0
    assert q.codes()[r, c].item() & 7 == 7


def test_packing_even_element_in_low_nibble() -> None:
    q = quantize(row([6.0, 0.5, -1.0, 3.0]))
    assert q.data.dtype == torch.uint8 and q.data.shape == (1, 8)
    assert q.data[0, :2].tolist() == [0x17, 0x5A]  # (7 | 1 << 4), (10 | 5 << 4)
    packed = torch.tensor([[0x17, 0x5A]], dtype=torch.uint8)
    assert unpack_codes(packed).tolist() == [[7, 1, 10, 5]]
    assert E2M1_VALUES[unpack_codes(packed).long()].tolist() == [[6.0, 0.5, -1.0, 3.0]]


def test_signed_zero_follows_te_reference_rule() -> None:
    q = quantize(row([6.0, -0.0, -0.2, 0.2]))
    assert q.codes()[0, :4].tolist() == [
        7,
        0,
        8,
        0,
    ]  # exact -0.0 -> 0; rounds-to-zero negative -> 8
    assert q.dequantize()[0, 1:4].abs().eq(0).all()


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_raises(bad: float) -> None:
    with pytest.raises(ValueError, match="non-finite"):
        quantize(row([1.0, bad]))


def test_shape_errors() -> None:
    with pytest.raises(ValueError, match="divisible"):
        quantize(torch.ones(2, 24))
    with pytest.raises(ValueError, match="divisible"):
        quantize(torch.ones(8, 16), tile=(16, 16))
    with pytest.raises(ValueError, match="2-D"):
        quantize(torch.ones(16))
    with pytest.raises(ValueError, match="tile"):
        quantize(torch.ones(16, 16), tile=(2, 16))


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 4),
    blocks=st.integers(1, 3),
    seed=st.integers(0, 2**31 - 1),
    spread=st.floats(0.0, 6.0),
    tile16=st.booleans(),
)
def test_dequantize_error_bound(
    rows: int, blocks: int, seed: int, spread: float, tile16: bool
) -> None:
    """Bound, for a block whose E4M3 scale is normal (>= 2^-6) with decode step d = s_b * S_dec.

    y = x/d is on the E2M1 grid scale. RN-even error is at most half the gap around y, which
    is <= 0.25 (|y| < 0.5) or <= |y|/4 (gaps 0.5, 1, 2 start at 1, 2, 4). s_b is within 2^-4
    (relative) of block_amax*S_enc/6, so |y| <= 6/(1 - 2^-4) = 6.4 and saturation costs at
    most |y| - 6 <= |y|/16. Hence |x - x_hat| <= |x|/4 + d/4, with
    d <= (1 + 2^-4) * block_amax / 6. Blocks whose scale is subnormal or underflowed
    (s_b < 2^-6) decode to |x_hat| = |q| * s_b * S_dec < 6 * 2^-6 * S_dec; for them only
    the weak bound |x - x_hat| <= |x| + 6 * 2^-6 * S_dec is checked.
    """
    gen = torch.Generator().manual_seed(seed)
    r = rows * (16 if tile16 else 1)
    x = torch.randn(r, 16 * blocks, generator=gen) * torch.exp(
        spread * torch.randn(r, 1, generator=gen)
    )
    q = quantize(x, tile=(16, 16) if tile16 else (1, 16))
    err = (q.dequantize() - x).abs()
    s_dec = (q.amax / 2688.0).item()
    tr = q.tile[0]
    s_b = q.scale.float().repeat_interleave(tr, 0).repeat_interleave(16, 1)
    d = s_b * s_dec
    normal = s_b >= 2.0**-6
    bound = x.abs() / 4 + d / 4
    slack = 1e-5 * (x.abs() + d)
    assert (err <= bound + slack)[normal].all()
    block_amax = x.abs().reshape(r // tr, tr, blocks, 16).amax(dim=(1, 3))
    bamax = block_amax.repeat_interleave(tr, 0).repeat_interleave(16, 1)
    assert (d <= (1 + 2.0**-4) * bamax / 6 * (1 + 1e-6))[normal].all()
    assert (err <= x.abs() + 6 * 2.0**-6 * s_dec * 1.01)[~normal].all()


def test_stochastic_rounding_is_unbiased_and_uses_neighbours() -> None:
    # Block amax 6 in a tensor of amax 6: s_b = 448 and enc_b = 1, so y == x exactly.
    vals = [6.0, 0.3, 0.6, 1.1, 2.2, 3.3, 4.9, -0.7, -1.6, -2.75, -5.5, 0.1, 1.5, 0.0, -4.0, 5.9]
    x = row(vals)
    n = 4000
    gen = torch.Generator().manual_seed(1234)
    q = quantize(x.repeat(n, 1), stochastic=True, generator=gen)  # each row is one draw
    assert q.scale.float().eq(448.0).all()
    deq = E2M1_VALUES[q.codes().long()]  # grid units: the decode step is 1 (up to an ulp)
    grid = np.concatenate([-GRID[::-1], GRID])
    for j, v in enumerate(vals):
        lo = grid[grid <= v].max()
        hi = grid[grid >= v].min()
        col = deq[:, j]
        assert set(col.tolist()) <= {float(lo), float(hi)}, (v, set(col.tolist()))
        if lo == hi:
            assert col.eq(v).all()
            continue
        p = (v - lo) / (hi - lo)
        se = (hi - lo) * np.sqrt(p * (1 - p) / n)
        assert abs(col.mean().item() - v) <= 4 * se, (v, col.mean().item(), se)
    again = quantize(x.repeat(n, 1), stochastic=True, generator=torch.Generator().manual_seed(1234))
    assert torch.equal(again.data, q.data)


def test_weight_tiles_are_transpose_consistent() -> None:
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(48, 32, generator=gen) * torch.exp(2 * torch.randn(48, 1, generator=gen))
    fprop = quantize(w, tile=(16, 16))
    bprop = quantize(w.T.contiguous(), tile=(16, 16))
    assert fprop.scale.shape == (3, 2) and bprop.scale.shape == (2, 3)
    assert torch.equal(fprop.scale.view(torch.uint8).T, bprop.scale.view(torch.uint8))
    assert torch.equal(fprop.dequantize(), bprop.dequantize().T)
    # 1x16 along rows does not have this property in general.
    row_wise = quantize(w).dequantize()
    col_wise = quantize(w.T.contiguous()).dequantize().T
    assert not torch.equal(row_wise, col_wise)
