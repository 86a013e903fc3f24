"""MoR: FP8-or-BF16 choice per tensor and per 1x128 block."""

from __future__ import annotations

import pytest
import torch

from factory.kernels.fp8 import quantize_blockwise, quantize_tensorwise
from factory.kernels.mor import MoRStats, choose, quantization_error


def bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).float()


def adversarial_block(n: int = 128) -> torch.Tensor:
    """amax 448 (scale 1) and ties at 272 that round to 256: rel. L2 error ~0.058."""
    x = torch.full((n,), 272.0)
    x[0] = 448.0
    return x


def outlier_tensor() -> torch.Tensor:
    """Bulk ~1 plus one 1e7 outlier: every bulk value underflows to 0 in E4M3."""
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(0))
    x[1, 5] = 1e7
    return x


def test_well_conditioned_tensor_stays_fp8() -> None:
    x = torch.randn(16, 256, generator=torch.Generator().manual_seed(1))
    r = choose(x)
    assert bool(r.decisions) and r.fp8_fraction == 1.0
    assert torch.equal(r.out, quantize_tensorwise(x).dequantize())
    assert 0.015 < r.errors.item() < 0.04


def test_adversarial_rounding_falls_back_to_bf16() -> None:
    x = adversarial_block() * 2.0**-9
    r = choose(x)
    expected = (16 * 16 * 127 / (448**2 + 127 * 272**2)) ** 0.5
    assert r.errors.item() == pytest.approx(expected, rel=1e-6)
    assert not bool(r.decisions) and r.fp8_fraction == 0.0
    assert torch.equal(r.out, bf16(x))
    assert bool(choose(x, threshold=0.06).decisions)


def test_outlier_underflow_needs_mean_rel_metric() -> None:
    x = outlier_tensor()
    # documented limitation: the magnitude-weighted metric barely sees the flushed bulk
    assert bool(choose(x).decisions)
    assert (quantize_tensorwise(x).dequantize() == 0).sum() == x.numel() - 1
    r = choose(x, metric="mean_rel")
    assert not bool(r.decisions) and r.errors.item() == pytest.approx(1.0, abs=1e-3)
    assert torch.equal(r.out, bf16(x))


def test_block_granularity_keeps_good_blocks() -> None:
    x = torch.randn(4, 512, generator=torch.Generator().manual_seed(2))
    x[2, 256:384] = adversarial_block() * 2.0**-8
    r = choose(x, granularity="block")
    assert r.decisions.shape == (4, 4)
    expected = torch.ones(4, 4, dtype=torch.bool)
    expected[2, 2] = False
    assert torch.equal(r.decisions, expected)
    assert r.fp8_fraction == 15 / 16
    fp8 = quantize_blockwise(x, (1, 128)).dequantize()
    bad = torch.zeros_like(x, dtype=torch.bool)
    bad[2, 256:384] = True
    assert torch.equal(r.out[~bad], fp8[~bad])
    assert torch.equal(r.out[bad], bf16(x)[bad])
    # the whole tensor still passes per tensor: the bad block is diluted
    assert bool(choose(x).decisions)


def test_block_granularity_outlier_block_mean_rel() -> None:
    x = outlier_tensor()  # outlier in row 1, block 0 (cols 0..127)
    r = choose(x, granularity="block", metric="mean_rel")
    assert r.decisions.sum().item() == 7 and not bool(r.decisions[1, 0])
    assert r.fp8_fraction == 7 / 8


def test_block_tail_and_zero_blocks() -> None:
    x = torch.zeros(3, 200)
    x[:, :128] = torch.randn(3, 128, generator=torch.Generator().manual_seed(3))
    r = choose(x, granularity="block")
    assert r.decisions.shape == (3, 2) and bool(r.decisions.all())  # zero tail: error 0
    assert torch.equal(r.errors[:, 1], torch.zeros(3))
    assert r.out.shape == x.shape


def test_quantization_error_metrics() -> None:
    x = torch.tensor([[3.0, 4.0, 0.0]])
    q = torch.tensor([[3.0, 0.0, 0.0]])
    assert quantization_error(x, q).item() == pytest.approx(4 / 5)
    assert quantization_error(x, q, "mean_rel").item() == pytest.approx(0.5)
    assert quantization_error(torch.zeros(1, 3), torch.zeros(1, 3)).item() == 0.0


def test_stats_accumulate_fraction() -> None:
    stats = MoRStats()
    assert stats.fp8_fraction == 1.0
    stats.update(choose(torch.randn(2, 64)))  # 1 FP8 tensor
    stats.update(choose(adversarial_block()))  # 1 BF16 tensor
    x = torch.randn(4, 512, generator=torch.Generator().manual_seed(2))
    x[2, 256:384] = adversarial_block() * 2.0**-8
    stats.update(choose(x, granularity="block"))  # 15 of 16 blocks
    assert (stats.fp8_units, stats.total_units, stats.calls) == (16, 18, 3)
    assert stats.fp8_fraction == 16 / 18


@pytest.mark.parametrize("granularity", ["tensor", "block"])
def test_non_finite_raises(granularity: str) -> None:
    x = torch.ones(2, 128)
    x[0, 0] = float("nan")
    with pytest.raises(ValueError):
        choose(x, granularity=granularity)  # type: ignore[arg-type]


def test_bad_arguments_raise() -> None:
    with pytest.raises(ValueError):
        choose(torch.ones(4), granularity="row")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        choose(torch.ones(4), metric="max")  # type: ignore[arg-type]
