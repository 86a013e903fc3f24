"""Shared helpers of the quantized-linear tests: data, one fwd+bwd run, errors."""

from __future__ import annotations

import torch

from factory.kernels.hadamard import rht
from factory.precision.qlinear import quantized_matmul
from factory.precision.quantizers import (
    GemmQuantizer,
)
from factory.schemas.precision import NVFP4Options

EXACT = NVFP4Options(stochastic_rounding=False)  # RHT on, SR off: every GEMM deterministic
PLAIN = NVFP4Options(stochastic_rounding=False, hadamard=False)


def data(
    seed: int, m: int, k: int, n: int, lead: tuple[int, ...] = ()
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gaussian x [*lead, m, k], w [*lead, n, k] (std 0.05, like an initialized weight), dy."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, m, k, generator=gen)
    w = 0.05 * torch.randn(*lead, n, k, generator=gen)
    dy = torch.randn(*lead, m, n, generator=gen)
    return x, w, dy


def run(
    quantizer: GemmQuantizer,
    x: torch.Tensor,
    w: torch.Tensor,
    dy: torch.Tensor,
    fwd: bool = True,
    bwd: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, dx, dw) of ``quantized_matmul`` for upstream gradient ``dy``."""
    xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = quantized_matmul(xl, wl, quantizer, fwd, bwd)
    y.backward(dy)
    assert xl.grad is not None and wl.grad is not None
    return y.detach(), xl.grad, wl.grad


def unquantized(
    x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 reference (y, dx, dw) of ``y = x @ wᵀ``."""
    return x @ w.transpose(-1, -2), dy @ w, dy.transpose(-1, -2) @ x


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def t(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(-1, -2)


def rht_tokens(m: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """RHT along the last (token) dim after zero-padding it to whole 16-tiles."""
    return rht(torch.nn.functional.pad(m, (0, -m.shape[-1] % 16)), signs)
