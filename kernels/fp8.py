"""FP8 quantization recipes emulated exactly on CPU.

Four scaling recipes, named as in Megatron-LM's ``--fp8-recipe`` (which maps
them to Transformer Engine recipes):

* :func:`quantize_tensorwise`: current per-tensor scaling (TE
  ``Float8CurrentScaling``). One fp32 scale from the tensor's own amax.
* :class:`DelayedScaling`: per-tensor scaling from an amax *history* of earlier
  calls (TE ``DelayedScaling``).
* :func:`quantize_blockwise`: DeepSeek-style blockwise scaling (TE
  ``Float8BlockScaling``): one fp32 scale per 1x128 block (activations,
  gradients) or 128x128 block (weights).
* :func:`quantize_mxfp8`: OCP Microscaling MXFP8 (TE ``MXFP8BlockScaling``):
  32-element blocks along the last dim with a power-of-two E8M0 shared scale.

Conventions shared by the FP8 recipes with fp32 scales, in Transformer Engine's
order and arithmetic (``transformer_engine/common/recipe/recipe_common.cuh``,
``compute_scale_from_amax``), bit for bit:

* ``scale`` is the *quantization* multiplier, TE's ``scale``:
  ``scale = fp32(FP8_MAX[fmt] / amax)`` (one correctly rounded fp32 division), so
  the amax maps onto the largest finite FP8 value. Where that division overflows
  (an amax below ``FP8_MAX / FLT_MAX``) the scale is ``FLT_MAX``; an all-zero
  tensor or block gets scale 1. TE's ``amax_epsilon`` and ``force_pow_2_scales``
  are 0 and off in its current-scaling recipe, and so here.
* Quantization computes ``y = x * scale`` in fp32, clamps ``y`` to
  ``[-FP8_MAX, FP8_MAX]`` (saturation, TE's ``satfinite`` conversion) and casts to
  the torch float8 dtype, which rounds to nearest, ties to even. Inputs are
  converted to fp32 first.
* :class:`FP8Tensor` keeps TE's ``scale_inv = fp32(1 / scale)``, the
  *dequantization* multiplier: ``x ~= data.float() * scale_inv``; it is what a
  scaled GEMM (``torch._scaled_mm``'s ``scale_a``/``scale_b``) takes.
* Blocks that do not fill the tensor (the tail along a dim that is not a
  multiple of the block edge) are allowed; they are scaled from their own
  elements only.
* A non-finite input (inf or NaN) raises :class:`ValueError`.

TE's ``Float8BlockScaling`` computes its block scales with the same function, by
default rounded down to a power of two (``force_pow_2_scales``); the blockwise
recipe here keeps the plain fp32 scales (the DeepSeek-V3 form) in TE's order
(``x * scale``, ``scale_inv = 1 / scale``).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Literal

import torch

from factory.kernels.tensor_parts import WHOLE, TensorPart

__all__ = [
    "FP8_DTYPE",
    "FP8_MAX",
    "MX_BLOCK",
    "MX_EMAX",
    "DelayedScaling",
    "FP8Tensor",
    "MXFP8Tensor",
    "as_finite_fp32",
    "block_view",
    "quantize_blockwise",
    "quantize_mxfp8",
    "quantize_tensorwise",
    "quantize_with_scale",
    "scale_from_amax",
    "scale_inverse",
]

FP8Format = Literal["e4m3", "e5m2"]

FP8_MAX: dict[str, float] = {"e4m3": 448.0, "e5m2": 57344.0}
FP8_DTYPE: dict[str, torch.dtype] = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
#: Exponent of the largest power of two in the element format (OCP MX ``emax_elem``).
MX_EMAX: dict[str, int] = {"e4m3": 8, "e5m2": 15}
MX_BLOCK = 32
_E8M0_BIAS = 127
_FP32_MAX = torch.finfo(torch.float32).max


def as_finite_fp32(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """Validate ``fmt`` and finiteness; return ``x`` as fp32."""
    if fmt not in FP8_MAX:
        raise ValueError(f"fmt must be one of {sorted(FP8_MAX)}, got {fmt!r}")
    if not torch.is_floating_point(x):
        raise ValueError(f"x must be a floating-point tensor, got {x.dtype}")
    x = x.to(torch.float32)
    if not bool(torch.isfinite(x).all()):
        raise ValueError("x contains inf or NaN; FP8 quantization needs finite inputs")
    return x


def scale_from_amax(amax: torch.Tensor, fmt: str, max_value: float | None = None) -> torch.Tensor:
    """TE's ``compute_scale_from_amax`` (epsilon 0, no power-of-two rounding): the fp32
    quantization scale ``max_value / amax`` (``FP8_MAX[fmt]`` by default), ``FLT_MAX``
    where that overflows, 1 where amax is 0, inf or NaN."""
    amax = amax.to(torch.float32)
    top = FP8_MAX[fmt] if max_value is None else max_value
    scale = torch.full_like(amax, top) / amax  # a true fp32 division (not 1 / amax * top)
    scale = torch.where(torch.isinf(scale), torch.full_like(scale, _FP32_MAX), scale)
    unusable = (amax == 0) | ~torch.isfinite(amax)
    return torch.where(unusable, torch.ones_like(scale), scale)


def scale_inverse(scale: torch.Tensor) -> torch.Tensor:
    """TE's ``scale_inv``: the fp32 reciprocal of the quantization scale, correctly rounded."""
    return torch.reciprocal(scale.to(torch.float32))


def _cast(y: torch.Tensor, fmt: str) -> torch.Tensor:
    """Saturate to the finite FP8 range, then round to nearest even by the cast."""
    limit = FP8_MAX[fmt]
    return y.clamp(-limit, limit).to(FP8_DTYPE[fmt])


@dataclass(frozen=True)
class FP8Tensor:
    """FP8 payload plus fp32 dequantization scale(s) ``scale_inv`` (TE's name).

    ``data`` has the original shape. ``scale_inv`` is 0-d for per-tensor scaling and
    ``[ceil(R / br), ceil(C / bc)]`` for blockwise scaling, where the tensor is
    viewed as ``[R, C] = [numel // last_dim, last_dim]`` and ``block = (br, bc)``.
    It is ``1 / scale`` of the quantization scale the codes were cast with.
    """

    data: torch.Tensor
    scale_inv: torch.Tensor
    fmt: str
    block: tuple[int, int] | None = None

    def scale_inv_per_element(self) -> torch.Tensor:
        """``scale_inv`` broadcast to ``data``'s shape."""
        if self.block is None:
            return self.scale_inv.expand(self.data.shape)
        return _expand_block_scale(self.scale_inv, self.block, self.data.shape)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``data * scale_inv`` computed in fp32, returned as ``dtype``."""
        return (self.data.to(torch.float32) * self.scale_inv_per_element()).to(dtype)


def quantize_tensorwise(
    x: torch.Tensor,
    fmt: FP8Format = "e4m3",
    part: TensorPart = WHOLE,
    *,
    check_finite: bool = True,
) -> FP8Tensor:
    """Current per-tensor scaling (TE ``Float8CurrentScaling``): ``scale = FP8_MAX[fmt] /
    amax(|x|)``, the amax of the whole tensor when ``x`` is ``part`` of one
    (``factory.kernels.tensor_parts``).

    ``check_finite=False`` skips the finiteness checks, each a wait for the device: a
    non-finite ``x`` then casts as TE casts it (scale 1, inf saturating to ``+-FP8_MAX``,
    NaN staying NaN) instead of raising. The real FP8 GEMMs cast so."""
    if not check_finite:
        if fmt not in FP8_MAX:
            raise ValueError(f"fmt must be one of {sorted(FP8_MAX)}, got {fmt!r}")
        x = x.to(torch.float32)
        scale = scale_from_amax(part.max(_amax(x)), fmt)
        return FP8Tensor(_cast(x * scale, fmt), scale_inverse(scale), fmt)
    x = as_finite_fp32(x, fmt)
    return quantize_with_scale(x, scale_from_amax(part.max(_amax(x)), fmt), fmt)


def _amax(x: torch.Tensor) -> torch.Tensor:
    """``max(|x|)`` as a 0-d fp32 tensor, 0 for an empty tensor."""
    return x.abs().max() if x.numel() else torch.zeros((), dtype=torch.float32, device=x.device)


def quantize_with_scale(x: torch.Tensor, scale: torch.Tensor | float, fmt: FP8Format) -> FP8Tensor:
    """Quantize with a given 0-d *quantization* ``scale``: ``fp8(x * scale)``, values beyond
    ``FP8_MAX / scale`` saturating; the result keeps ``scale_inv = 1 / scale``."""
    x = as_finite_fp32(x, fmt)
    scale = torch.as_tensor(scale, dtype=torch.float32).reshape(())
    if not bool(scale > 0) or not bool(torch.isfinite(scale)):
        raise ValueError(f"scale must be positive and finite, got {float(scale)}")
    return FP8Tensor(_cast(x * scale, fmt), scale_inverse(scale), fmt)


class DelayedScaling:
    """Per-tensor scaling from an amax history, following TE ``DelayedScaling``.

    Semantics (one instance per tensor role, e.g. one layer's activations):

    * :meth:`quantize` uses the current :attr:`scale` (1 before any call), so the
      scale always lags the data by at least one call. Values that exceed the
      range implied by that scale saturate to ``+-FP8_MAX``.
    * Then it appends ``amax(|x|)`` to a rolling history of ``history_len``
      entries and recomputes the scale from the history as TE's
      ``amax_and_scale_update`` does: ``scale = fp32(FP8_MAX * 2**-margin) / amax_h``
      with ``amax_h`` the history max (``"max"``) or the amax just recorded
      (``"most_recent"``); ``FLT_MAX`` where that overflows (TE's current scaling
      does so; its delayed kernel would store inf).
    * If ``amax_h`` is 0 the previous scale is kept (as in TE).

    ``scale`` is TE's quantization multiplier; the tensors it returns carry
    ``scale_inv = 1 / scale``.
    """

    def __init__(
        self,
        history_len: int = 1024,
        amax_compute: Literal["max", "most_recent"] = "max",
        margin: int = 0,
        fmt: FP8Format = "e4m3",
    ) -> None:
        if history_len < 1:
            raise ValueError(f"history_len must be >= 1, got {history_len}")
        if amax_compute not in ("max", "most_recent"):
            raise ValueError(f"amax_compute must be 'max' or 'most_recent', got {amax_compute!r}")
        if fmt not in FP8_MAX:
            raise ValueError(f"fmt must be one of {sorted(FP8_MAX)}, got {fmt!r}")
        self.amax_compute = amax_compute
        self.margin = margin
        self.fmt: FP8Format = fmt
        self.history: deque[float] = deque(maxlen=history_len)
        self.scale = torch.ones((), dtype=torch.float32)

    def quantize(self, x: torch.Tensor, part: TensorPart = WHOLE) -> FP8Tensor:
        """Quantize with the scale from earlier calls, then record ``x``'s amax (the whole
        tensor's when ``x`` is ``part`` of one)."""
        out = quantize_with_scale(x, self.scale, self.fmt)
        self.history.append(float(part.max(_amax(x.to(torch.float32)))))
        amax = max(self.history) if self.amax_compute == "max" else self.history[-1]
        if amax > 0:
            scaled_max = float(torch.tensor(FP8_MAX[self.fmt] * 2.0**-self.margin).float())
            amax_t = torch.tensor(amax, dtype=torch.float32)
            self.scale = scale_from_amax(amax_t, self.fmt, scaled_max)
        return out


def _as_rows(x: torch.Tensor) -> torch.Tensor:
    """View ``x`` as ``[numel // last_dim, last_dim]`` (a 0-d tensor as ``[1, 1]``)."""
    if x.ndim == 0:
        return x.reshape(1, 1)
    return x.reshape(-1, x.shape[-1])


def block_view(x2: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Zero-pad a 2D tensor to whole blocks and view it as ``[nbr, br, nbc, bc]``."""
    br, bc = block
    rows, cols = x2.shape
    nbr, nbc = -(-rows // br), -(-cols // bc)
    padded = torch.nn.functional.pad(x2, (0, nbc * bc - cols, 0, nbr * br - rows))
    return padded.reshape(nbr, br, nbc, bc)


def _expand_block_scale(
    scale: torch.Tensor, block: tuple[int, int], shape: torch.Size
) -> torch.Tensor:
    """Broadcast a ``[nbr, nbc]`` block scale to a tensor of ``shape``."""
    cols = shape[-1] if len(shape) else 1
    rows = shape.numel() // cols if cols else 0
    full = scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    return full[:rows, :cols].reshape(shape)


def quantize_blockwise(
    x: torch.Tensor, block: tuple[int, int] = (1, 128), fmt: FP8Format = "e4m3"
) -> FP8Tensor:
    """DeepSeek-style blockwise current scaling, one fp32 scale per block, each computed and
    applied in TE's order (``scale = FP8_MAX / block_amax``, ``fp8(x * scale)``).

    ``x`` is viewed as ``[numel // last_dim, last_dim]``; use ``block=(1, 128)``
    for activations and gradients and ``(128, 128)`` for weights. Tail blocks
    are allowed and scaled from their own elements.
    """
    x = as_finite_fp32(x, fmt)
    if x.ndim == 0 or len(block) != 2 or min(block) < 1:
        raise ValueError(f"need x.ndim >= 1 and a positive 2D block, got {x.ndim=} {block=}")
    block = (int(block[0]), int(block[1]))
    amax = block_view(_as_rows(x), block).abs().amax(dim=(1, 3))
    scale = scale_from_amax(amax, fmt)
    data = _cast(x * _expand_block_scale(scale, block, x.shape), fmt)
    return FP8Tensor(data, scale_inverse(scale), fmt, block)


def _pow2(e: torch.Tensor) -> torch.Tensor:
    """Exact ``2.0 ** e`` as float64 for integer ``e`` in [-1022, 1023], built from the bits."""
    return ((e.to(torch.int64) + 1023) << 52).view(torch.float64)


@dataclass(frozen=True)
class MXFP8Tensor:
    """MXFP8 payload: FP8 elements and one E8M0 scale per 32 elements of the last dim.

    ``scale`` has shape ``[*x.shape[:-1], ceil(last_dim / 32)]`` and dtype
    ``torch.float8_e8m0fnu`` (biased exponent, bias 127); :attr:`scale_exp` gives
    the unbiased exponent so that ``x ~= data * 2**scale_exp``.
    """

    data: torch.Tensor
    scale: torch.Tensor
    fmt: str

    @property
    def scale_exp(self) -> torch.Tensor:
        """Unbiased int32 exponent of each block scale."""
        return self.scale.view(torch.uint8).to(torch.int32) - _E8M0_BIAS

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``data * 2**scale_exp`` (exact in float64), returned as ``dtype``."""
        pow2 = _pow2(self.scale_exp).repeat_interleave(MX_BLOCK, -1)[..., : self.data.shape[-1]]
        return (self.data.to(torch.float64) * pow2).to(dtype)


def quantize_mxfp8(x: torch.Tensor, fmt: FP8Format = "e4m3") -> MXFP8Tensor:
    """OCP MX quantization with 32-element blocks along the last dim.

    Per block: ``scale_exp = floor(log2(amax)) - MX_EMAX[fmt]`` (clamped to the
    E8M0 range [-127, 127]; an all-zero block gets -127), elements are
    ``x / 2**scale_exp`` cast to FP8 with saturation. The block amax lands in
    ``[2**emax, 2**(emax + 1))`` before the cast, so amaxes above ``FP8_MAX``
    in element space (e.g. >= 464 for E4M3) saturate to ``FP8_MAX``.
    A tail block shorter than 32 is allowed.
    """
    x = as_finite_fp32(x, fmt)
    if x.ndim == 0:
        raise ValueError("quantize_mxfp8 needs x.ndim >= 1")
    cols = x.shape[-1]
    blocks = block_view(_as_rows(x), (1, MX_BLOCK))  # [R, 1, nb, 32]
    amax = blocks.abs().amax(dim=(1, 3))  # [R, nb]
    _, exp = torch.frexp(amax)  # amax = m * 2**exp with m in [0.5, 1)
    scale_exp = (exp.to(torch.int32) - 1) - MX_EMAX[fmt]
    scale_exp = torch.where(amax == 0, -_E8M0_BIAS, scale_exp).clamp(-_E8M0_BIAS, _E8M0_BIAS)
    inv = _pow2(-scale_exp).repeat_interleave(MX_BLOCK, -1)[:, :cols]
    y = (_as_rows(x).to(torch.float64) * inv).to(torch.float32).reshape(x.shape)
    scale = (scale_exp + _E8M0_BIAS).to(torch.uint8).view(torch.float8_e8m0fnu)
    return MXFP8Tensor(_cast(y, fmt), scale.reshape(*x.shape[:-1], -1), fmt)
