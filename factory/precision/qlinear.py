"""The quantized linear: one autograd function that quantizes each GEMM's operands.

``quantized_matmul(x, w, quantizer)`` computes ``x @ wᵀ`` for ``x [.., M, K]`` and
``w [.., N, K]`` (leading dims batch the experts of a grouped GEMM), with
operands quantized per GEMM as :mod:`factory.precision.quantizers` describes:

* fprop: ``y  = input(x) @ weight(w)ᵀ``
* dgrad: ``dx = grad(dy) @ dgrad_weight(w)``
* wgrad: ``dw = dyᵀ' @ xᵀ'ᵀ`` with ``(dyᵀ', xᵀ') = wgrad(dy, x)``

On CPU this is the emulation: the quantizers return dequantized fp32 values and
the matmuls run in fp32; the result is cast back to the input's dtype. Master
weights and their gradients stay in the parameters' dtype (fp32 in training, as
in the paper, §4.1). ``fwd``/``bwd`` switch quantization of the forward GEMM and
of the two backward GEMMs independently (``switch_to_bf16`` with scope
``forward`` keeps the backward quantized).

On a CUDA GPU with FP8 tensor cores the per-tensor FP8 recipes take the real
path instead (``_ScaledMatmul``): the same casts as FP8 codes, each GEMM one
``torch._scaled_mm`` (``factory.kernels.fp8_gemm``) with E4M3 forward operands,
E5M2 gradients under ``format: hybrid``, fp32 accumulation and BF16 output (the
weight gradient in the weight's dtype). The tokens are padded with zero codes to a
multiple of 16; a weight whose dimensions are not multiples of 16 stays emulated,
with a warning.

Under tensor parallelism the modules run on this rank's local tensors and carry a
:class:`~factory.precision.splits.GemmSplit` (``factory.distributed.tensor_parallel``
sets it), which every quantizer call receives: split operands are quantized with the
whole tensor's statistics, as one process would.

Under ``training.compile`` the quantized GEMM runs eagerly inside the compiled block
(``torch.compiler.disable``, in torch's lazy form, on :func:`quantized_matmul`, a graph
break on either side):
the emulation keeps Python-side state that a graph cannot hold (the weight-cast cache
keyed on the parameter's version, delayed scaling's amax history, MoR's counters, the
stochastic-rounding generator, whose state checkpoints save) and checks its inputs for
non-finite values, and inductor's CPU backend has no C++ type for MXFP8's
``float8_e8m0fnu`` scales. Run eagerly, the casts and the random numbers are the eager
run's, bit for bit, and a resumed compiled run draws what the uninterrupted one would.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from factory.kernels import fp8_gemm
from factory.kernels.fp8 import FP8Tensor
from factory.precision.quantizers import FP8Quantizer, GemmQuantizer
from factory.precision.splits import WHOLE_GEMM, GemmSplit

__all__ = ["QuantizedExpertLinear", "QuantizedLinear", "quantized_matmul"]

_F32 = torch.float32


class _QuantizedMatmul(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        x: torch.Tensor,
        w: torch.Tensor,
        quantizer: GemmQuantizer,
        fwd: bool,
        bwd: bool,
        split: GemmSplit,
        source: torch.Tensor | None,
    ) -> torch.Tensor:
        xf = x.to(_F32)
        w_fprop = quantizer.fprop_weight(w, split, source) if fwd else None
        x_fprop = quantizer.input(xf, split) if fwd else None
        y = (x_fprop if fwd else xf) @ (w_fprop if fwd else w.to(_F32)).transpose(-1, -2)
        # x_fprop is kept only for recipes whose wgrad reuses it (per-tensor FP8).
        ctx.save_for_backward(x, w, w_fprop, x_fprop if quantizer.reuses_casts else None)
        ctx.quantizer, ctx.bwd, ctx.split = quantizer, bwd, split
        return y.to(x.dtype)

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx, dy: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        x, w, w_fprop, x_fprop = ctx.saved_tensors
        q: GemmQuantizer = ctx.quantizer
        split: GemmSplit = ctx.split
        xf, wf, dyf = x.to(_F32), w.to(_F32), dy.to(_F32)
        dx = dw = dy_q = None
        if ctx.needs_input_grad[0]:
            if ctx.bwd:
                dy_q = q.grad(dyf, split)
                dx = dy_q @ q.dgrad_weight(wf, w_fprop, split)
            else:
                dx = dyf @ wf
            dx = dx.to(x.dtype)
        if ctx.needs_input_grad[1]:
            if ctx.bwd:
                dy_t, x_t = q.wgrad(dyf, xf, dy_q, x_fprop, split)
                dw = dy_t @ x_t.transpose(-1, -2)
            else:
                dw = dyf.transpose(-1, -2) @ xf
            dw = dw.to(w.dtype)
        return dx, dw, None, None, None, None, None


def _t(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(-1, -2)


def _fp8_gemm(a: FP8Tensor, b: FP8Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``a @ b`` of FP8 operands ``[.., m, k]`` and ``[.., k, n]`` (views, transposed as the
    GEMM needs them): one ``torch._scaled_mm`` per matrix."""
    if a.data.ndim == 2:
        return fp8_gemm.scaled_matmul(a.data, a.scale_inv, b.data, b.scale_inv, out_dtype)
    products = [
        fp8_gemm.scaled_matmul(*fp8_gemm.matrix(a, e), *fp8_gemm.matrix(b, e), out_dtype)
        for e in range(a.data.shape[0])
    ]
    return torch.stack(products)


def _transposed(t: FP8Tensor) -> FP8Tensor:
    return FP8Tensor(_t(t.data), t.scale_inv, t.fmt)


class _ScaledMatmul(torch.autograd.Function):
    """The quantized linear on FP8 tensor cores: the operands of :class:`_QuantizedMatmul`
    as codes (``FP8Quantizer.scaled_cast``), each GEMM a ``torch._scaled_mm``."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        x: torch.Tensor,
        w: torch.Tensor,
        quantizer: FP8Quantizer,
        fwd: bool,
        bwd: bool,
        split: GemmSplit,
        source: torch.Tensor | None,
    ) -> torch.Tensor:
        xf = x.to(_F32)
        # x itself is kept only where a backward GEMM needs it unquantized or cast afresh.
        saved: tuple[torch.Tensor | None, ...] = (x, None, None, None, None)
        tokens = x.shape[-2]
        if fwd:
            x_q = fp8_gemm.pad_rows(quantizer.scaled_cast(xf, "input", split.part("tokens", "in")))
            w_q = quantizer.scaled_fprop_weight(w, split, source)
            y = _fp8_gemm(x_q, _transposed(w_q), torch.bfloat16)[..., :tokens, :]
            saved = (x if not bwd else None, x_q.data, x_q.scale_inv, w_q.data, w_q.scale_inv)
        else:
            y = xf @ _t(w.to(_F32))
        ctx.save_for_backward(w, *saved)
        ctx.quantizer, ctx.bwd, ctx.split, ctx.fwd_fmt = quantizer, bwd, split, quantizer.fwd_fmt
        ctx.x_dtype, ctx.tokens = x.dtype, tokens
        return y.to(x.dtype)

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx, dy: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        w, x, x_data, x_scale_inv, w_data, w_scale_inv = ctx.saved_tensors
        q: FP8Quantizer = ctx.quantizer
        split: GemmSplit = ctx.split
        x_q = None if x_data is None else FP8Tensor(x_data, x_scale_inv, ctx.fwd_fmt)
        w_q = None if w_data is None else FP8Tensor(w_data, w_scale_inv, ctx.fwd_fmt)
        dyf = dy.to(_F32)
        dx = dw = dy_q = None
        if not ctx.bwd:
            if ctx.needs_input_grad[0]:
                dx = (dyf @ w.to(_F32)).to(ctx.x_dtype)
            if ctx.needs_input_grad[1]:
                dw = (_t(dyf) @ x.to(_F32)).to(w.dtype)
            return dx, dw, None, None, None, None, None
        # Padded token rows are zero codes: they add nothing to dW and their dx rows are cut.
        if ctx.needs_input_grad[0]:
            dy_q = fp8_gemm.pad_rows(q.scaled_cast(dyf, "grad", split.part("tokens", "out")))
            if w_q is None:
                w_q = q.scaled_cast(w.detach().to(_F32), "weight", split.part("out", "in"))
            dx = _fp8_gemm(dy_q, w_q, torch.bfloat16)[..., : ctx.tokens, :].to(ctx.x_dtype)
        if ctx.needs_input_grad[1]:
            if dy_q is None:
                dy_q = fp8_gemm.pad_rows(q.scaled_cast(dyf, "grad", split.part("tokens", "out")))
            if x_q is None:
                x_q = fp8_gemm.pad_rows(
                    q.scaled_cast(x.to(_F32), "input", split.part("tokens", "in"))
                )
            out = torch.float32 if w.dtype == torch.float32 else torch.bfloat16
            dw = _fp8_gemm(_transposed(dy_q), x_q, out).to(w.dtype)
        return dx, dw, None, None, None, None, None


def _scaled_path(
    x: torch.Tensor, w: torch.Tensor, quantizer: GemmQuantizer, fwd: bool, bwd: bool
) -> bool:
    """Whether this GEMM runs on FP8 tensor cores: the recipe can there
    (``runs_scaled_gemm``, the test ``gemm_kernel`` reports) and ``torch._scaled_mm`` takes
    its shape (else it is emulated, with a warning)."""
    if not (fwd or bwd) or not quantizer.runs_scaled_gemm(x.device.type):
        return False
    misaligned = fp8_gemm.misaligned(w.shape[-1], w.shape[-2])
    if misaligned is not None:
        quantizer.warn_emulated(misaligned)
        return False
    return True


# torch.compiler.disable would import torch._dynamo (with sympy and triton: about a second
# and 150 MiB) when this module loads, in every build; torch's lazy form imports it on the
# first call instead, and only a run that calls the GEMM pays for it.
@torch._disable_dynamo
def quantized_matmul(
    x: torch.Tensor,
    w: torch.Tensor,
    quantizer: GemmQuantizer,
    fwd: bool = True,
    bwd: bool = True,
    split: GemmSplit = WHOLE_GEMM,
    source: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ wᵀ`` with quantized operands; ``x [.., M, K]``, ``w [N, K]`` or ``[B, N, K]``.

    With a 2-D ``w``, every leading dim of ``x`` is folded into M (tokens): the
    scales of a linear layer cover the whole micro-batch, as in TE. ``split`` says
    which of the GEMM's dimensions are this rank's part of a tensor-parallel split;
    ``source`` is the parameter ``w`` is a local view of, which keys the weight cast
    cache (``GemmQuantizer.fprop_weight``). Never traced by ``torch.compile`` (see the
    module docstring).
    """
    lead = x.shape[:-1]
    if w.ndim == 2:
        x = x.reshape(-1, x.shape[-1])
    function = _ScaledMatmul if _scaled_path(x, w, quantizer, fwd, bwd) else _QuantizedMatmul
    y = function.apply(x, w, quantizer, fwd, bwd, split, source)
    return y.reshape(*lead, w.shape[-2]) if w.ndim == 2 else y


class QuantizedLinear(nn.Linear):
    """``nn.Linear`` whose GEMMs run through a quantizer; same parameters, same state dict.

    Built from an existing linear by :meth:`from_linear`, which shares its
    parameters, so swapping a model's linears changes no weights or checkpoint keys.
    The bias is added in high precision after the GEMM.
    """

    quantizer: GemmQuantizer
    quantize_forward: bool
    quantize_backward: bool
    split: GemmSplit
    """Where its GEMM's dimensions lie over the tensor-parallel group (whole on one process)."""

    @classmethod
    def from_linear(cls, linear: nn.Linear, quantizer: GemmQuantizer) -> QuantizedLinear:
        module = cls.__new__(cls)
        nn.Module.__init__(module)
        module.in_features, module.out_features = linear.in_features, linear.out_features
        module.weight = linear.weight
        module.bias = linear.bias
        module.quantizer = quantizer
        module.quantize_forward = module.quantize_backward = True
        module.split = WHOLE_GEMM
        module.train(linear.training)
        return module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (self.quantize_forward or self.quantize_backward):
            return F.linear(x, self.weight, self.bias)
        # Under tensor parallelism self.weight is a local view of the registered parameter,
        # which is the one the weight cast cache must follow.
        y = quantized_matmul(
            x,
            self.weight,
            self.quantizer,
            self.quantize_forward,
            self.quantize_backward,
            self.split,
            source=self._parameters["weight"],
        )
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self.quantizer.recipe}"


class QuantizedExpertLinear:
    """The GEMM hook of a grouped expert layer: one quantizer per projection.

    ``RoutedExperts`` calls it as ``linear(name, x [E, C, in], w [E, out, in])``;
    projections without a quantizer (BF16 by policy) run a plain batched matmul.
    """

    def __init__(self, quantizers: dict[str, GemmQuantizer]) -> None:
        self.quantizers = quantizers
        self.quantize_forward = self.quantize_backward = True

    def __call__(self, name: str, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """Each rank's own tokens: under TP (ETP = 1) a rank routes its tokens to whole experts,
        so their GEMMs quantize per rank, as under data parallelism (``docs/distributed.md``)."""
        quantizer = self.quantizers.get(name)
        if quantizer is None or not (self.quantize_forward or self.quantize_backward):
            return torch.bmm(x, w.transpose(1, 2))
        return quantized_matmul(x, w, quantizer, self.quantize_forward, self.quantize_backward)
