"""Generated CUDA kernels (recipe step ``kind: cuda_kernel``): verified, and faster than their reference.

The rule and its default are factory's own (docs/data.md, Trajectory and
CUDA-kernel filters).
"""

from __future__ import annotations

import math
from typing import Any

from factory.data.steps.filter_registry import register_filter
from factory.data.steps.records import Document, RawRecord
from factory.schemas.data_recipe import CudaKernelFilter

__all__ = ["cuda_kernel_reason"]


@register_filter(CudaKernelFilter)
def cuda_kernel_reason(record: RawRecord, doc: Document, params: CudaKernelFilter) -> str | None:
    """``unverified``, ``missing_benchmark``, ``slow_kernel`` or None."""
    data = record.data
    if params.require_verified and data.get("verified") is not True:
        return "unverified"
    if params.min_speedup <= 0:
        return None
    bench = data.get("benchmark")
    if not isinstance(bench, dict):
        return "missing_benchmark"
    reference, kernel = bench.get("reference_ms"), bench.get("kernel_ms")
    if not (_positive(reference) and _positive(kernel)):
        return "missing_benchmark"
    if reference / kernel < params.min_speedup:
        return "slow_kernel"
    return None


def _positive(value: Any) -> bool:
    return (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value > 0
    )
