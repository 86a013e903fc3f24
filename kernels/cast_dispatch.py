"""Which implementation casts a GEMM operand: the Triton kernels for CUDA tensors when Triton is
installed, the PyTorch emulation everywhere else (``docs/precision.md``, 'Triton kernels').

This module is the one place that imports Triton, lazily and only for a CUDA
tensor, so importing ``factory`` or running on CPU never loads it. Both paths
take the same arguments and give the same values: the kernels are bit-exact
with the emulation (``factory.kernels.triton_nvfp4``, ``triton_fp8``), the
global amax of a split tensor goes through the same ``TensorPart.max``, and
stochastic rounding uses the numbers ``TensorPart.uniform`` draws on the
operand's device from the quantizer's generator (``tensor_parts.draw_uniform``), so
both paths round alike on the same device.
The one place they may differ is the 16x16 rotation: the emulation multiplies
matrices, the kernel sums in a fixed order, and the two can round a rotated value
differently in its last bit.
"""

from __future__ import annotations

import functools
import importlib.util
import math
from types import ModuleType

import torch
import torch.nn.functional as F

from factory.kernels import fp8, hadamard, nvfp4
from factory.kernels.tensor_parts import WHOLE, TensorPart

__all__ = ["fp8_tensorwise", "mxfp8", "nvfp4_fake_quantize", "triton_kernels"]

_RUN = 16


@functools.cache
def _triton_modules() -> tuple[ModuleType, ModuleType] | None:
    """(triton_nvfp4, triton_fp8), or None where Triton is not installed."""
    if importlib.util.find_spec("triton") is None:
        return None
    import factory.kernels.triton_fp8 as triton_fp8
    import factory.kernels.triton_nvfp4 as triton_nvfp4

    return triton_nvfp4, triton_fp8


def triton_kernels(x: torch.Tensor) -> tuple[ModuleType, ModuleType] | None:
    """The Triton kernel modules that serve ``x``: only a non-empty CUDA tensor, only when
    Triton imports; None means the emulation."""
    if not x.is_cuda or x.numel() == 0:
        return None
    return _triton_modules()


def nvfp4_fake_quantize(
    x: torch.Tensor,
    tile: tuple[int, int] = (1, 16),
    stochastic: bool = False,
    generator: torch.Generator | None = None,
    part: TensorPart = WHOLE,
    rht_signs: torch.Tensor | None = None,
) -> torch.Tensor:
    """``nvfp4.fake_quantize`` (same arguments and values) on either path. With ``rht_signs``
    the columns are zero-padded to whole runs of 16 and rotated by ``hadamard.rht`` first;
    the result keeps the padded width."""
    if rht_signs is not None and x.shape[-1] % _RUN:
        x = F.pad(x, (0, -x.shape[-1] % _RUN))
    kernels = triton_kernels(x)
    if kernels is None:
        if rht_signs is not None:
            x = hadamard.rht(x, rht_signs)
        return nvfp4.fake_quantize(x, tile, stochastic, generator, part)
    triton_nvfp4 = kernels[0]
    amax = part.max(triton_nvfp4.global_amax(x, tile, rht_signs))
    uniform = None
    if stochastic:
        rows, cols = x.shape[-2:]
        padded = (math.prod(x.shape[:-2]), rows + -rows % tile[0], cols + -cols % _RUN)
        uniform = part.uniform(torch.Size(padded), generator, x.device)
    return triton_nvfp4.fake_quantize(x, tile, amax=amax, uniform=uniform, rht_signs=rht_signs)


def fp8_tensorwise(x: torch.Tensor, fmt: fp8.FP8Format, part: TensorPart = WHOLE) -> torch.Tensor:
    """fp32 values of FP8 current scaling of each matrix of ``x [..., rows, cols]``, each with
    its whole tensor's amax when it is ``part`` of one."""
    kernels = triton_kernels(x)
    if kernels is None:
        if x.ndim == 2:
            return fp8.quantize_tensorwise(x, fmt, part).dequantize()
        flat = x.reshape(-1, *x.shape[-2:])
        out = [fp8.quantize_tensorwise(m, fmt, part).dequantize() for m in flat]
        return torch.stack(out).reshape(x.shape)
    triton_fp8 = kernels[1]
    amax = part.max(triton_fp8.matrix_amax(x))
    return triton_fp8.fake_quantize_tensorwise(x, fmt, amax=amax)


def mxfp8(x: torch.Tensor, fmt: fp8.FP8Format = "e4m3") -> torch.Tensor:
    """fp32 values of MXFP8 quantization of ``x`` (32-element blocks along the last dim)."""
    kernels = triton_kernels(x)
    if kernels is None:
        return fp8.quantize_mxfp8(x, fmt).dequantize()
    return kernels[1].fake_quantize_mxfp8(x, fmt)
