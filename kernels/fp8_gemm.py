"""FP8 GEMMs on tensor cores through ``torch._scaled_mm``, per-tensor scaled (TE's HYBRID format).

A GEMM of two :class:`~factory.kernels.fp8.FP8Tensor` operands cast with per-tensor
scales (``fp8.quantize_tensorwise`` or ``fp8.DelayedScaling``, Transformer Engine's
arithmetic) runs as one ``torch._scaled_mm``: the FP8 codes multiply on the tensor
cores, the products accumulate in fp32, the sum is multiplied by both operands'
``scale_inv`` and rounded once to BF16. That is the emulation's result (dequantized
operands, fp32 matmul) up to fp32 summation order and that final BF16 rounding.

``torch._scaled_mm`` takes its first operand row-major and its second column-major,
with every dimension a multiple of 16 on the GPU; :func:`scaled_matmul` lays the
operands out so. The tokens are padded with zero codes to a multiple of 16
(:func:`pad_rows`: zero rows leave the scales, the other rows and the weight
gradient's sum unchanged); :func:`misaligned` names the weight dimensions that are
not multiples, where the caller keeps the emulation. E4M3 x E4M3 (fprop) and E5M2 x E4M3 (dgrad, wgrad) are
the pairs the hardware multiplies.

FP8 tensor cores exist from compute capability 8.9 (Ada, Hopper) on.
:func:`scaled_mm_unavailable` is the one test the dispatch
(``factory.precision.qlinear``) and the kernel report (:func:`fp8_gemm_kernel`) ask.
"""

from __future__ import annotations

import torch

from factory.kernels.choice import KernelChoice
from factory.kernels.fp8 import FP8Tensor

__all__ = [
    "EMULATED",
    "MIN_CAPABILITY",
    "TENSOR_CORES",
    "fp8_gemm_kernel",
    "misaligned",
    "pad_rows",
    "scaled_matmul",
    "scaled_mm_unavailable",
]

MIN_CAPABILITY = (8, 9)
"""The first compute capability with FP8 tensor cores (Ada; Hopper is 9.0)."""
ALIGN = 16
"""``torch._scaled_mm`` on the GPU wants every GEMM dimension a multiple of this."""
TENSOR_CORES = "torch._scaled_mm (FP8 tensor cores, fp32 accumulate, BF16 out)"
EMULATED = "emulated (dequantize + fp32 matmul)"
OP = "fp8 gemm"


def scaled_mm_unavailable(device: str) -> str | None:
    """Why FP8 GEMMs cannot run on ``device``'s tensor cores (``"cuda"``, ``"cpu"``); None
    where they can. CPU tensors keep the emulation, the reference."""
    if device != "cuda":
        return f"{device} tensors use the emulation (the reference)"
    if not torch.cuda.is_available():
        return "CUDA is not available"
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) < MIN_CAPABILITY:
        return f"compute capability {major}.{minor} < {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]}"
    return None


def fp8_gemm_kernel(device: str, op: str = OP) -> KernelChoice:
    """What runs a per-tensor-scaled FP8 GEMM on ``device``: the tensor cores where
    :func:`scaled_mm_unavailable` says nothing, else the emulation (a fallback on CUDA,
    the reference on CPU). Shapes :func:`misaligned` names are emulated call by call
    (the quantizer warns once)."""
    reason = scaled_mm_unavailable(device)
    if reason is None:
        return KernelChoice(op, TENSOR_CORES)
    return KernelChoice(op, EMULATED, reason if device == "cuda" else None)


def misaligned(in_features: int, out_features: int) -> str | None:
    """The weight dimensions of a linear that ``torch._scaled_mm`` refuses (not a multiple of
    16), or None. The tokens need no check: :func:`pad_rows` pads them."""
    sizes = (("in_features", in_features), ("out_features", out_features))
    bad = [f"{name}={size}" for name, size in sizes if size % ALIGN]
    return f"{', '.join(bad)} not a multiple of {ALIGN}" if bad else None


def pad_rows(t: FP8Tensor) -> FP8Tensor:
    """``t`` (``[.., rows, cols]``) with zero codes appended to a multiple of 16 rows (the
    same tensor where it has them)."""
    rows = t.data.shape[-2]
    if rows % ALIGN == 0:
        return t
    bits = torch.nn.functional.pad(t.data.view(torch.uint8), (0, 0, 0, -rows % ALIGN))
    return FP8Tensor(bits.view(t.data.dtype), t.scale_inv, t.fmt, t.block)


def scaled_matmul(
    a: torch.Tensor,
    a_scale_inv: torch.Tensor,
    b: torch.Tensor,
    b_scale_inv: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """``(a * a_scale_inv) @ (b * b_scale_inv)`` for FP8 codes ``a [m, k]``, ``b [k, n]`` and
    0-d fp32 dequantization scales, as one ``torch._scaled_mm``: ``a`` is made row-major and
    ``b`` column-major (a copy only where they are not already)."""
    a = a if a.is_contiguous() else a.contiguous()
    b = b if b.t().is_contiguous() else b.t().contiguous().t()
    return torch._scaled_mm(
        a,
        b,
        scale_a=a_scale_inv.to(torch.float32).reshape(()),
        scale_b=b_scale_inv.to(torch.float32).reshape(()),
        out_dtype=out_dtype,
    )


def matrix(t: FP8Tensor, index: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scale_inv) of matrix ``index`` of a batched operand (None: a 2-D one); a
    batched operand carries one scale per matrix or one shared by all."""
    if index is None:
        return t.data, t.scale_inv
    scales = t.scale_inv.reshape(-1)
    return t.data[index], scales[index if scales.numel() > 1 else 0]
