"""FP8 (blockwise, delayed), MXFP8 and MoR in the quantized linear: which values each GEMM
uses, how delayed scaling keeps its history, and what MoR counts."""

from __future__ import annotations

import torch
from precision_helpers import data, rel, run, t

from factory.kernels import fp8
from factory.precision.qlinear import quantized_matmul
from factory.precision.quantizers import (
    FP8Quantizer,
    MoRQuantizer,
    MXFP8Quantizer,
)
from factory.schemas.precision import FP8Options, MoROptions

# --- MXFP8 and FP8 blockwise: which values each GEMM uses -------------------------------------------


def mx(a: torch.Tensor) -> torch.Tensor:
    return fp8.quantize_mxfp8(a, "e4m3").dequantize()


def test_mxfp8_blocks_along_each_gemms_reduction_dim() -> None:
    x, w, dy = data(16, 64, 96, 64)
    y, dx, dw = run(MXFP8Quantizer(), x, w, dy)
    assert torch.equal(y, mx(x) @ mx(w).T)
    assert torch.equal(dx, mx(dy) @ t(mx(w.T)))  # re-blocked along N: other values than fprop's
    assert not torch.equal(t(mx(w.T)), mx(w))
    assert torch.equal(dw, mx(dy.T) @ mx(x.T).T)


def test_fp8_blockwise_weight_blocks_serve_fprop_and_dgrad() -> None:
    """Blockwise is E4M3 for gradients too (DeepSeek-V3, TE Float8BlockScaling), even
    under the default ``format: hybrid``."""
    x, w, dy = data(17, 64, 256, 160)
    y, dx, dw = run(FP8Quantizer(FP8Options(scaling="blockwise")), x, w, dy)

    def qb(a: torch.Tensor, block: tuple[int, int], fmt: fp8.FP8Format = "e4m3") -> torch.Tensor:
        return fp8.quantize_blockwise(a, block, fmt).dequantize()

    w_q = qb(w, (128, 128))
    assert torch.equal(y, qb(x, (1, 128)) @ w_q.T)
    assert torch.equal(dx, qb(dy, (1, 128)) @ w_q)
    assert torch.equal(dw, qb(dy.T, (1, 128)) @ qb(x.T, (1, 128)).T)


# --- FP8 delayed scaling ------------------------------------------------------------------------------


def with_scale(
    a: torch.Tensor, scale: torch.Tensor | float, fmt: fp8.FP8Format = "e4m3"
) -> torch.Tensor:
    return fp8.quantize_with_scale(a, scale, fmt).dequantize()


def scale_of(a: torch.Tensor, fmt: fp8.FP8Format = "e4m3") -> torch.Tensor:
    """TE's quantization scale for ``a``'s amax: ``fp32(FP8_MAX / amax)``."""
    return torch.tensor(fp8.FP8_MAX[fmt]) / torch.tensor(float(a.abs().max()))


def test_fp8_delayed_scale_lags_one_call() -> None:
    """Each role (input, weight, grad) quantizes with the scale of the amaxes seen before:
    1 on the first call, FP8_MAX / amax(previous) on the next. wgrad reuses the scales
    that fprop and dgrad used in the same step."""
    q = FP8Quantizer(FP8Options(scaling="delayed", format="hybrid", amax_history_len=4))
    x1, w, dy1 = data(18, 48, 64, 32)
    x2, _, dy2 = data(19, 48, 64, 32)
    x2, dy2 = 1000.0 * x2, 0.001 * dy2  # the lagging scales saturate x2 and flush dy2

    y1, dx1, dw1 = run(q, x1, w, dy1)
    assert torch.equal(y1, with_scale(x1, 1.0) @ with_scale(w, 1.0).T)
    assert torch.equal(dx1, with_scale(dy1, 1.0, "e5m2") @ with_scale(w, 1.0))
    assert torch.equal(dw1, with_scale(dy1, 1.0, "e5m2").T @ with_scale(x1, 1.0))

    y2, dx2, dw2 = run(q, x2, w, dy2)
    s_x, s_w, s_g = scale_of(x1), scale_of(w), scale_of(dy1, "e5m2")
    x_q, w_q, dy_q = with_scale(x2, s_x), with_scale(w, s_w), with_scale(dy2, s_g, "e5m2")
    assert torch.equal(y2, x_q @ w_q.T)
    assert torch.equal(dx2, dy_q @ w_q)
    assert torch.equal(dw2, dy_q.T @ x_q)
    assert float(x_q.abs().max()) <= float(x1.abs().max()) * 1.0001  # saturated at the old amax
    assert len(q.delayed["input"].history) == 2
    assert q.delayed["input"].history[-1] == float(x2.abs().max())
    assert torch.equal(q.delayed["input"].scale, scale_of(x2))  # ready for the next call


def test_fp8_delayed_experts_share_one_history() -> None:
    q = FP8Quantizer(FP8Options(scaling="delayed"))
    x, w, dy = data(20, 16, 32, 16, lead=(3,))
    run(q, x, w, dy)
    assert list(q.delayed["input"].history) == [float(x.abs().max())]
    assert list(q.delayed["weight"].history) == [float(w.abs().max())]


def test_fp8_delayed_wgrad_when_the_input_needs_no_grad() -> None:
    """Without dgrad (x needs no gradient) wgrad casts the gradient itself."""
    q = FP8Quantizer(FP8Options(scaling="delayed"))
    x, w, dy = data(21, 32, 64, 16)
    wl = w.clone().requires_grad_()
    quantized_matmul(x, wl, q).backward(dy)
    assert wl.grad is not None


def test_fp8_delayed_wgrad_after_the_forward_switch_tracks_the_input() -> None:
    """Once the forward runs unquantized (``switch_to_bf16`` with scope ``forward``) there
    is no fprop cast to reuse: wgrad casts x itself through the input's amax history.
    Delayed scaling lags by one cast, so the first step after a 100x jump saturates (as
    it would in the forward); the next one has caught up. Before the fix wgrad kept the
    last forward's scale for good (97% error on every later step)."""
    q = FP8Quantizer(FP8Options(scaling="delayed", format="e4m3"))
    for seed in range(3):
        run(q, *data(30 + seed, 32, 64, 16))
    x, w, dy = data(40, 32, 64, 16)
    x = 100.0 * x
    _, _, first = run(q, x, w, dy, fwd=False)
    _, _, second = run(q, x, w, dy, fwd=False)
    assert rel(first, dy.T @ x) > 0.5
    assert rel(second, dy.T @ x) < 0.1


# --- MoR -----------------------------------------------------------------------------------------


def test_mor_stats_count_units_per_tensor() -> None:
    """Tensor granularity: one unit per operand matrix. A 2-D linear's step quantizes
    input, weight, grad and wgrad's dyᵀ and xᵀ (dgrad reuses fprop's weight): 5 units;
    with 3 experts every operand is 3 matrices: 15 more."""
    q = MoRQuantizer(MoROptions())
    run(q, *data(22, 48, 64, 32))
    assert (q.stats.calls, q.stats.total_units, q.stats.fp8_units) == (5, 5, 5)
    run(q, *data(23, 16, 32, 16, lead=(3,)))
    assert (q.stats.calls, q.stats.total_units, q.stats.fp8_units) == (20, 20, 20)
    assert q.stats.fp8_fraction == 1.0


def test_mor_stats_count_units_per_block() -> None:
    m, k, n, b = 48, 64, 40, 32
    q = MoRQuantizer(MoROptions(granularity="block", block_size=b))
    run(q, *data(24, m, k, n))

    def blocks(rows: int, cols: int) -> int:
        return rows * -(-cols // b)

    expected = blocks(m, k) + blocks(n, k) + blocks(m, n) + blocks(n, m) + blocks(k, m)
    assert q.stats.calls == 5
    assert q.stats.total_units == expected == q.stats.fp8_units


def test_mor_falls_back_to_bf16_above_the_threshold() -> None:
    x, w, dy = data(25, 48, 64, 32)
    strict = MoRQuantizer(MoROptions(threshold=1e-9))
    y, _, _ = run(strict, x, w, dy)
    assert strict.stats.fp8_units == 0 and strict.stats.total_units == 5
    bf16 = x.bfloat16().float() @ w.bfloat16().float().T
    assert torch.equal(y, bf16)
    # With every tensor in FP8, MoR is FP8 E4M3 tensorwise current scaling.
    lax = MoRQuantizer(MoROptions(threshold=0.99))
    got = run(lax, x, w, dy)
    want = run(FP8Quantizer(FP8Options(format="e4m3")), x, w, dy)
    assert lax.stats.fp8_units == 5
    for g, r in zip(got, want, strict=True):
        assert torch.equal(g, r)
