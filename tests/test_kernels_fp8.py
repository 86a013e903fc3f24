"""FP8 recipes: exact hand-made cases and hypothesis error bounds.

Error bound used by the property tests (derivation). Let ``s`` be an element's
dequantization scale ``scale_inv``, ``y = fl32(x * scale)`` and ``q = RNE_fp8(clamp(y))``. For
``|y|`` in the FP8 normal range (``>= 2**-6`` for E4M3, ``>= 2**-14`` for E5M2)
with ``m`` mantissa bits and ``u = 2**-(m+1)`` (half an ulp relative to the
binade start ``2**e``), ``|q - y| <= u * 2**e <= u / (1 + u) * |y|``, because an
error of ``u * 2**e`` needs ``|y| >= (1 + u) * 2**e`` (the clamp only trims the
amax overshoot of one fp32 ulp). The fp32 product ``x * scale``, the reciprocal
``s = 1 / scale`` and the fp32 product ``q * s`` add at most ``2**-24`` relative each, so
``|deq - x| / |x| <= u / (1 + u) + 2**-22``: ``1/17`` (E4M3, ``u = 2**-4``) and
``1/9`` (E5M2, ``u = 2**-3``) up to fp32 noise; both are attained. In the subnormal range the absolute error is at
most half the subnormal step times ``s``: ``s * 2**-10`` (E4M3) and
``s * 2**-17`` (E5M2), plus the same fp32 noise. For MXFP8 ``s`` is a power of
two, so the fp32 terms vanish.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from factory.kernels.fp8 import (
    FP8_DTYPE,
    FP8_MAX,
    MX_EMAX,
    DelayedScaling,
    quantize_blockwise,
    quantize_mxfp8,
    quantize_tensorwise,
)

MANTISSA = {"e4m3": 3, "e5m2": 2}
MIN_NORMAL = {"e4m3": 2.0**-6, "e5m2": 2.0**-14}
HALF_SUB_STEP = {"e4m3": 2.0**-10, "e5m2": 2.0**-17}
FMTS = ["e4m3", "e5m2"]


def check_bounds(x: torch.Tensor, deq: torch.Tensor, s: torch.Tensor, fmt: str) -> None:
    """Assert the documented per-element bounds given per-element scales ``s``."""
    x, deq, s = x.double(), deq.double(), s.double()
    y = (x.float() / s.float()).double()
    err = (deq - x).abs()
    normal = y.abs() >= MIN_NORMAL[fmt]
    u = 2.0 ** -(MANTISSA[fmt] + 1)
    rel_bound = u / (1 + u) + 2.0**-22
    assert bool((err[normal] <= rel_bound * x.abs()[normal]).all())
    sub = ~normal
    abs_bound = s[sub] * HALF_SUB_STEP[fmt] * (1 + 2.0**-20) + 2.0**-22 * x.abs()[sub]
    assert bool((err[sub] <= abs_bound).all())


def random_tensor(seed: int, shape: tuple[int, ...], spread: int, offset: int) -> torch.Tensor:
    """Normal values times ``2**u``, ``u`` uniform in [-spread, spread], shifted by ``2**offset``."""
    g = torch.Generator().manual_seed(seed)
    u = (torch.rand(shape, generator=g) * 2 - 1) * spread + offset
    return torch.randn(shape, generator=g) * torch.exp2(u)


# ---------------------------------------------------------------- exact cases


@pytest.mark.parametrize("fmt", FMTS)
def test_tensorwise_exact_values_round_trip(fmt: str) -> None:
    top = FP8_MAX[fmt]
    x = torch.tensor([top, -top, 1.0, -0.5, 0.0, 96.0, 2.0**-6])  # scale is exactly 1
    q = quantize_tensorwise(x, fmt)
    assert (
        q.scale_inv.item() == 1.0
        and q.data.dtype == {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}[fmt]
    )
    assert torch.equal(q.dequantize(), x)
    # a power-of-two multiple keeps every element code identical
    q2 = quantize_tensorwise(x * 2.0**-20, fmt)
    assert torch.equal(q2.data.view(torch.uint8), q.data.view(torch.uint8))
    assert torch.equal(q2.dequantize(), x * 2.0**-20)


def test_round_to_nearest_even() -> None:
    # scale 1; in [256, 512) the E4M3 step is 32: 272 is a tie -> 256 (even), 304 -> 320
    q = quantize_tensorwise(torch.tensor([448.0, 272.0, 304.0, 271.0, 273.0]))
    assert q.dequantize().tolist() == [448.0, 256.0, 320.0, 256.0, 288.0]


@pytest.mark.parametrize("fmt", FMTS)
def test_saturation_with_fixed_scale(fmt: str) -> None:
    top = FP8_MAX[fmt]
    ds = DelayedScaling(fmt=fmt)  # first call: scale 1, so large values saturate
    q = ds.quantize(torch.tensor([1e6, -1e6, top * 1.07, 3.0]))
    assert q.dequantize().tolist() == [top, -top, top, 3.0]


@pytest.mark.parametrize("fmt", FMTS)
def test_amax_maps_to_fp8_max(fmt: str) -> None:
    x = torch.tensor([3.1, -0.2, 0.7])
    q = quantize_tensorwise(x, fmt)
    assert q.data.float().abs().max().item() == FP8_MAX[fmt]
    scale = torch.tensor(FP8_MAX[fmt]) / x[0]  # TE: one fp32 division, then its reciprocal
    assert torch.equal(q.scale_inv, torch.reciprocal(scale))


def test_zero_tensor() -> None:
    x = torch.zeros(4, 200)
    for q in (quantize_tensorwise(x), quantize_blockwise(x), quantize_blockwise(x, (128, 128))):
        assert torch.all(q.scale_inv == 1.0) and torch.equal(q.dequantize(), x)
    mx = quantize_mxfp8(x)
    assert torch.all(mx.scale_exp == -127) and torch.equal(mx.dequantize(), x)


@pytest.mark.parametrize(
    "fn", [quantize_tensorwise, quantize_blockwise, quantize_mxfp8, DelayedScaling().quantize]
)
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_non_finite_raises(fn, bad: float) -> None:
    x = torch.ones(2, 64)
    x[1, 3] = bad
    with pytest.raises(ValueError):
        fn(x)


def test_bad_format_raises() -> None:
    with pytest.raises(ValueError):
        quantize_tensorwise(torch.ones(3), "e3m4")  # type: ignore[arg-type]


# ------------------------------------------------------------ delayed scaling


def test_delayed_scaling_uses_previous_amax() -> None:
    ds = DelayedScaling(history_len=4, amax_compute="max")
    q1 = ds.quantize(torch.tensor([2.0, -1.0]))
    assert q1.scale_inv.item() == 1.0  # empty history
    q2 = ds.quantize(torch.tensor([0.5, 0.25]))
    assert q2.scale_inv.item() == pytest.approx(2.0 / 448, rel=2**-23)  # first call's amax
    q3 = ds.quantize(torch.tensor([0.1]))
    assert q3.scale_inv.item() == pytest.approx(2.0 / 448, rel=2**-23)  # history max is still 2
    assert list(ds.history) == [2.0, 0.5, pytest.approx(0.1)]


def test_delayed_scaling_most_recent_and_window() -> None:
    recent = DelayedScaling(history_len=8, amax_compute="most_recent")
    window = DelayedScaling(history_len=2, amax_compute="max")
    for amax in (8.0, 1.0, 0.5):
        recent.quantize(torch.tensor([amax]))
        window.quantize(torch.tensor([amax]))
    assert recent.scale.item() == 448 / 0.5  # only the last amax matters
    assert window.scale.item() == 448 / 1.0  # 8.0 rolled out of the 2-entry window


def test_delayed_scaling_margin_and_zero_amax() -> None:
    ds = DelayedScaling(margin=1)
    ds.quantize(torch.tensor([448.0]))
    assert ds.scale.item() == 0.5  # (448 * 2**-1) / 448
    zero = DelayedScaling(amax_compute="most_recent")
    zero.quantize(torch.tensor([4.48]))
    kept = zero.scale.clone()
    zero.quantize(torch.zeros(3))
    assert torch.equal(zero.scale, kept)  # a zero amax keeps the previous scale


# ------------------------------------------------------------------ blockwise


def test_blockwise_isolates_outlier() -> None:
    x = random_tensor(0, (4, 384), spread=2, offset=0)
    base = quantize_blockwise(x).dequantize()
    x_out = x.clone()
    x_out[2, 200] = 1e5  # block (row 2, cols 128..255)
    q = quantize_blockwise(x_out)
    deq = q.dequantize()
    assert q.scale_inv.shape == (4, 3)
    untouched = torch.ones_like(x, dtype=torch.bool)
    untouched[2, 128:256] = False
    assert torch.equal(deq[untouched], base[untouched])
    assert q.scale_inv[2, 1].item() == pytest.approx(1e5 / 448, rel=2**-22)
    # the per-tensor recipe would spread the outlier's scale everywhere
    tw = quantize_tensorwise(x_out).dequantize()
    assert (tw - x_out)[untouched].abs().sum() > 3 * (deq - x_out)[untouched].abs().sum()


def test_blockwise_2d_blocks_and_tails() -> None:
    x = random_tensor(1, (130, 260), spread=4, offset=0)
    q = quantize_blockwise(x, (128, 128))
    assert q.scale_inv.shape == (2, 3) and q.data.shape == x.shape
    for i, rs in enumerate((slice(0, 128), slice(128, 130))):
        for j, cs in enumerate((slice(0, 128), slice(128, 256), slice(256, 260))):
            amax = x[rs, cs].abs().max()
            assert q.scale_inv[i, j].item() == torch.reciprocal(torch.tensor(448.0) / amax).item()
    check_bounds(x, q.dequantize(), q.scale_inv_per_element(), "e4m3")


# ---------------------------------------------------------------------- MXFP8


@pytest.mark.parametrize("fmt", FMTS)
def test_mxfp8_scales_are_powers_of_two(fmt: str) -> None:
    x = random_tensor(2, (3, 100), spread=12, offset=-3)  # tail block of 4
    x[1, 32:64] = 0.0
    q = quantize_mxfp8(x, fmt)
    assert q.scale.dtype == torch.float8_e8m0fnu and q.scale.shape == (3, 4)
    e = q.scale_exp
    assert e[1, 1].item() == -127  # zero block
    blocks = torch.nn.functional.pad(x, (0, 28)).reshape(3, 4, 32).double()
    amax = blocks.abs().amax(-1)
    elem_amax = amax * torch.exp2(-e.double())
    nz = amax > 0
    emax = MX_EMAX[fmt]
    assert bool(((elem_amax[nz] >= 2.0**emax) & (elem_amax[nz] < 2.0 ** (emax + 1))).all())
    # the stored E8M0 value equals 2**scale_exp exactly
    assert torch.equal(q.scale.float().double(), torch.exp2(e.double()))
    # quantized block max: round-to-nearest of elem_amax, saturated at FP8_MAX
    qmax = q.data.double().abs().reshape(3, -1)
    qmax = torch.nn.functional.pad(qmax, (0, 28)).reshape(3, 4, 32).amax(-1)
    expect = elem_amax.float().to(q.data.dtype).double().clamp(max=FP8_MAX[fmt])
    assert torch.equal(qmax[nz], expect[nz])
    pow2 = torch.exp2(e.double()).repeat_interleave(32, -1)[:, :100]
    check_bounds(x, q.dequantize(), pow2, fmt)


def test_mxfp8_saturates_large_block_max() -> None:
    # amax 500 -> scale_exp = 8 - 8 = 0 -> 500 is above 448 in element space -> 448
    x = torch.tensor([[500.0, 1.0] + [0.0] * 30])
    q = quantize_mxfp8(x)
    assert q.scale_exp.item() == 0 and q.dequantize()[0, 0].item() == 448.0
    # 480 would be exactly 2**8 * 1.875, the E4M3 NaN code: it must not appear
    assert not bool(torch.isnan(q.dequantize()).any())


def test_mxfp8_nd_shape() -> None:
    x = random_tensor(3, (2, 3, 64), spread=3, offset=5)
    q = quantize_mxfp8(x)
    assert q.data.shape == x.shape and q.scale.shape == (2, 3, 2)
    assert q.dequantize().shape == x.shape


# ------------------------------------------------------------ property tests

shapes = st.tuples(st.integers(1, 5), st.integers(1, 300))
params = {
    "seed": st.integers(0, 2**31 - 1),
    "shape": shapes,
    "spread": st.integers(0, 40),
    "offset": st.integers(-60, 60),
    "fmt": st.sampled_from(FMTS),
}


@settings(max_examples=60, deadline=None)
@given(**params)
def test_tensorwise_error_bound(seed, shape, spread, offset, fmt) -> None:
    x = random_tensor(seed, shape, spread, offset)
    q = quantize_tensorwise(x, fmt)
    check_bounds(x, q.dequantize(), q.scale_inv_per_element(), fmt)
    assert q.data.float().abs().max().item() == FP8_MAX[fmt]


@settings(max_examples=40, deadline=None)
@given(**params, block=st.sampled_from([(1, 128), (128, 128), (2, 7)]))
def test_blockwise_error_bound(seed, shape, spread, offset, fmt, block) -> None:
    x = random_tensor(seed, shape, spread, offset)
    q = quantize_blockwise(x, block, fmt)
    check_bounds(x, q.dequantize(), q.scale_inv_per_element(), fmt)


@settings(max_examples=40, deadline=None)
@given(**params)
def test_mxfp8_error_bound(seed, shape, spread, offset, fmt) -> None:
    x = random_tensor(seed, shape, spread, offset)
    q = quantize_mxfp8(x, fmt)
    pow2 = torch.exp2(q.scale_exp.double()).repeat_interleave(32, -1)[:, : shape[1]]
    deq = q.dequantize()
    # in-range blocks obey the rounding bound; saturated ones lose < 1/8 (y in [max, 2**(emax+1)))
    sat = q.data.double().abs() == FP8_MAX[fmt]
    check_bounds(x[~sat], deq[~sat], pow2[~sat], fmt)
    assert bool(
        ((deq - x).abs()[sat] <= x.abs()[sat] * (1 - FP8_MAX[fmt] / 2 ** (MX_EMAX[fmt] + 1))).all()
    )


@pytest.mark.parametrize("fmt", FMTS)
def test_relative_bound_is_attained(fmt: str) -> None:
    # scale 1: y = (1 + u) * 2 sits on a tie and rounds to even (2): error u / (1 + u)
    u = 2.0 ** -(MANTISSA[fmt] + 1)
    x = torch.tensor([FP8_MAX[fmt], (1 + u) * 2.0])
    err = (quantize_tensorwise(x, fmt).dequantize() - x).abs() / x.abs()
    assert err[1].item() == pytest.approx(u / (1 + u), rel=1e-6)


# ------------------------------------------- Transformer Engine's order, bit for bit


def fp8_grid(fmt: str) -> torch.Tensor:
    """Every finite non-negative value of the format, as float64, in code order (codes 0..)."""
    codes = torch.arange(128, dtype=torch.uint8).view(FP8_DTYPE[fmt]).double()
    return codes[torch.isfinite(codes)]


def te_reference(x: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """TE's current scaling written out independently of ``factory.kernels.fp8``: (codes as
    float64, scale_inv). Each fp32 operation is done in float64 and rounded once to fp32,
    which is exact for products and correctly rounded for quotients (53 >= 2 * 24 + 2,
    so the double rounding is innocuous); the FP8 rounding is a nearest-value search of the
    format's grid, ties to the even code."""
    flt_max = torch.finfo(torch.float32).max
    amax = float(x.abs().max()) if x.numel() else 0.0
    if amax == 0.0:
        scale = 1.0
    else:
        scale = float(torch.tensor(FP8_MAX[fmt] / amax, dtype=torch.float64).float())
        scale = flt_max if scale == float("inf") else scale
    scale_inv = torch.tensor(1.0 / scale, dtype=torch.float64).float()
    y = (x.double() * scale).float().double()  # one fp32 rounding of the exact product
    a = y.abs().clamp(max=FP8_MAX[fmt]).reshape(-1)
    grid = fp8_grid(fmt)
    hi = torch.searchsorted(grid, a).clamp(max=len(grid) - 1)
    lo = (hi - 1).clamp(min=0)
    d_lo, d_hi = a - grid[lo], grid[hi] - a
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0))
    codes = torch.where(pick_hi, grid[hi], grid[lo]).reshape(x.shape)
    return torch.copysign(codes, y), scale_inv


def te_order_tensor(seed: int, shape: tuple[int, ...], spread: int, offset: int) -> torch.Tensor:
    """Like ``random_tensor`` but built in float64 so amaxes reach fp32's subnormals."""
    g = torch.Generator().manual_seed(seed)
    u = (torch.rand(shape, generator=g, dtype=torch.float64) * 2 - 1) * spread + offset
    return (torch.randn(shape, generator=g, dtype=torch.float64) * torch.exp2(u)).float()


@settings(max_examples=150, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    shape=st.sampled_from(
        [(1,), (3,), (1, 1), (7, 5), (16, 48), (33, 130), (2, 64, 96), (256, 1024)]
    ),
    spread=st.integers(0, 30),
    # from fp32 subnormal amaxes (where FP8_MAX / amax overflows to FLT_MAX) to ~2**124
    offset=st.integers(-150, 95),
    zero=st.booleans(),
    fmt=st.sampled_from(FMTS),
)
def test_tensorwise_is_transformer_engines_arithmetic(seed, shape, spread, offset, zero, fmt):
    x = torch.zeros(shape) if zero else te_order_tensor(seed, shape, spread, offset)
    q = quantize_tensorwise(x, fmt)
    codes, scale_inv = te_reference(x, fmt)
    assert torch.equal(q.data.double().view(torch.int64), codes.view(torch.int64))  # -0 kept
    assert torch.equal(q.scale_inv.view(torch.int32), scale_inv.view(torch.int32))


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("amax", [0.0, 2.0**-149, 1e-40, 2.0**-126, 1e-36, 1e-30, 1.0, 3e38])
def test_tensorwise_edge_amaxes(fmt: str, amax: float) -> None:
    """A zero tensor (scale 1), subnormal amaxes, the overflow of FP8_MAX / amax
    (scale FLT_MAX) and an amax near FLT_MAX, against the reference."""
    x = torch.tensor([amax, -amax / 3, amax / 1024, 0.0], dtype=torch.float32)
    q = quantize_tensorwise(x, fmt)
    codes, scale_inv = te_reference(x, fmt)
    assert torch.equal(q.data.double(), codes)
    assert torch.equal(q.scale_inv, scale_inv)
    overflows = 0 < amax < FP8_MAX[fmt] / torch.finfo(torch.float32).max
    if overflows:
        assert torch.equal(q.scale_inv, torch.reciprocal(torch.tensor(torch.finfo().max)))


def test_te_order_differs_from_dividing_by_the_dequant_scale() -> None:
    """The old order, ``fp8(x / s)`` with ``s = amax / FP8_MAX`` dequantized by ``s``, gives
    other values on many tensors (``1 / fp32(FP8_MAX / amax)`` is not ``amax / FP8_MAX``),
    so the reference tests above can tell the two apart."""
    differs = 0
    for seed in range(40):
        x = torch.randn(256, generator=torch.Generator().manual_seed(seed))
        s = x.abs().max() / 448.0
        old = (x / s).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s
        differs += int(not torch.equal(old, quantize_tensorwise(x).dequantize()))
    assert differs >= 5


@pytest.mark.parametrize("fmt", FMTS)
def test_unchecked_cast_is_the_checked_one_and_casts_non_finite_as_te(fmt: str) -> None:
    """``check_finite=False`` (the real GEMMs' cast, no wait for the device) gives the same
    codes on finite input; a non-finite amax gets scale 1, inf saturates, NaN stays NaN."""
    x = te_order_tensor(3, (16, 48), 10, -3)
    checked, unchecked = (
        quantize_tensorwise(x, fmt),
        quantize_tensorwise(x, fmt, check_finite=False),
    )
    assert torch.equal(checked.data.view(torch.uint8), unchecked.data.view(torch.uint8))
    assert torch.equal(checked.scale_inv, unchecked.scale_inv)
    bad = torch.tensor([float("inf"), -2.0, float("nan")])
    q = quantize_tensorwise(bad, fmt, check_finite=False)
    assert q.scale_inv.item() == 1.0
    assert q.data.float()[:2].tolist() == [FP8_MAX[fmt], -2.0] and q.data.float()[2].isnan()
