"""Mixture of Representations (MoR): per tensor or per block, FP8 or BF16.

MoR (arXiv 2512.22804) measures how well FP8 represents a tensor and keeps the
FP8 version only where the quantization error stays under a threshold; the
rest is kept in BF16. The paper's exact metric, threshold and block size are
not verified (``docs/precision.md``, 'MoR'). This module implements a plausible
reading of it:

* quantize to FP8 with current amax scaling, per tensor
  (:func:`~factory.kernels.fp8.quantize_tensorwise`) or per ``1 x block`` block
  along the last dim (:func:`~factory.kernels.fp8.quantize_blockwise`);
* measure the error of the dequantized values against the original (fp32)
  values; an all-zero unit has error 0;
* error ``<= threshold``: use the FP8 values, else the BF16-rounded values.

Metrics (``metric=``):

* ``"rel_l2"`` (default): ``||q(x) - x||_2 / ||x||_2``. It is magnitude
  weighted, so it is driven by mantissa rounding of the large values and is
  nearly blind to underflow: with amax scaling, each E4M3 element in the normal
  range has relative error <= 2**-4 and each subnormal-range element an
  absolute error <= scale * 2**-10, so the metric is at most about
  ``2**-4 + sqrt(n) * 2**-10 / 448`` with ``n`` the element count, whatever
  the dynamic range. A tensor whose small values flush to zero next to an
  outlier therefore usually still passes.
* ``"mean_rel"``: the mean over nonzero elements of ``|q(x) - x| / |x|``. Every
  flushed element counts as error 1, so it catches underflow from outliers.

For scale: a standard-normal tensor has ``rel_l2`` about 0.027 in E4M3 and about
0.052 in E5M2, so the default threshold 0.05 is meant for E4M3.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from factory.kernels.fp8 import (
    FP8Format,
    as_finite_fp32,
    block_view,
    quantize_blockwise,
    quantize_tensorwise,
)
from factory.kernels.tensor_parts import WHOLE, TensorPart

__all__ = ["MoRResult", "MoRStats", "choose", "quantization_error"]

Metric = Literal["rel_l2", "mean_rel"]


@dataclass(frozen=True)
class MoRResult:
    """Outcome of :func:`choose`.

    ``out`` (fp32, shape of ``x``) holds the dequantized FP8 values where FP8 was
    chosen and the BF16-rounded values elsewhere. ``decisions`` is True where
    FP8 was kept: 0-d for tensor granularity, ``[rows, ceil(last_dim / block)]``
    for block granularity (``rows = numel // last_dim``). ``errors`` has the
    same shape and holds the measured metric.
    """

    out: torch.Tensor
    fp8_fraction: float
    decisions: torch.Tensor
    errors: torch.Tensor


def quantization_error(
    x: torch.Tensor, q: torch.Tensor, metric: Metric = "rel_l2", part: TensorPart = WHOLE
) -> torch.Tensor:
    """Error of ``q`` against ``x`` reduced over the last two dims of ``[..., a, b]`` inputs;
    over the whole tensor when ``x`` is ``part`` of one (its sums are summed over the parts).

    Returns 0 where ``x`` is all zero.
    """
    diff = (q - x).abs()
    if metric == "rel_l2":
        num = part.sum(diff.square().sum(dim=(-2, -1))).sqrt()
        den = part.sum(x.square().sum(dim=(-2, -1))).sqrt()
    elif metric == "mean_rel":
        nonzero = x != 0
        rel = torch.where(nonzero, diff / torch.where(nonzero, x.abs(), 1.0), 0.0)
        num = part.sum(rel.sum(dim=(-2, -1)))
        den = part.sum(nonzero.sum(dim=(-2, -1)).to(x.dtype))
    else:
        raise ValueError(f"metric must be 'rel_l2' or 'mean_rel', got {metric!r}")
    return torch.where(den > 0, num / torch.where(den > 0, den, 1.0), 0.0)


def choose(
    x: torch.Tensor,
    threshold: float = 0.05,
    granularity: Literal["tensor", "block"] = "tensor",
    block: int = 128,
    fmt: FP8Format = "e4m3",
    metric: Metric = "rel_l2",
    part: TensorPart = WHOLE,
) -> MoRResult:
    """Pick FP8 or BF16 for ``x`` as a whole or per ``1 x block`` block of the last dim.

    With ``granularity="tensor"``, ``x`` may be ``part`` of a tensor split over processes:
    the amax and the error are the whole tensor's, so every part makes the same choice
    (blocks need nothing from the other parts)."""
    xf = as_finite_fp32(x, fmt)
    bf16 = xf.to(torch.bfloat16).to(torch.float32)
    if granularity == "tensor":
        q = quantize_tensorwise(xf, fmt, part).dequantize()
        err = quantization_error(xf.reshape(1, -1), q.reshape(1, -1), metric, part)
        keep = err <= threshold
        out = q if bool(keep) else bf16
        return MoRResult(out, float(keep), keep, err)
    if granularity != "block":
        raise ValueError(f"granularity must be 'tensor' or 'block', got {granularity!r}")
    if x.ndim == 0 or block < 1:
        raise ValueError(
            f"block granularity needs x.ndim >= 1 and block >= 1, got {x.ndim=} {block=}"
        )
    q = quantize_blockwise(xf, (1, block), fmt).dequantize()
    rows_x = xf.reshape(-1, xf.shape[-1])
    xb = block_view(rows_x, (1, block))  # [R, 1, nb, block]
    qb = block_view(q.reshape(rows_x.shape), (1, block))
    err = quantization_error(xb.permute(0, 2, 1, 3), qb.permute(0, 2, 1, 3), metric)  # [R, nb]
    keep = err <= threshold
    mask = keep.repeat_interleave(block, -1)[:, : rows_x.shape[1]].reshape(x.shape)
    out = torch.where(mask, q, bf16)
    frac = float(keep.float().mean()) if keep.numel() else 1.0
    return MoRResult(out, frac, keep, err)


@dataclass
class MoRStats:
    """Running count of the units (tensors or blocks) kept in FP8 across calls."""

    fp8_units: int = 0
    total_units: int = 0
    calls: int = field(default=0)

    def update(self, result: MoRResult) -> None:
        """Add one :func:`choose` result."""
        self.fp8_units += int(result.decisions.sum())
        self.total_units += result.decisions.numel()
        self.calls += 1

    @property
    def fp8_fraction(self) -> float:
        """Fraction of all units seen so far that were kept in FP8 (1.0 before any)."""
        return self.fp8_units / self.total_units if self.total_units else 1.0
