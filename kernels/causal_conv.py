"""Which implementation runs the Mamba mixer's depthwise causal conv1d, and why.

CUDA tensors go to the Triton kernel (``factory.kernels.triton_causal_conv``, forward and
backward, documents kept apart through ``seq_idx``) when Triton imports; everything else, and
CUDA without Triton, takes the PyTorch shifted multiply-adds of
``factory.layers.mamba.module``, which stay the reference. This module is the one place that
imports the kernel, lazily: importing it costs nothing on CPU.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
from collections.abc import Callable

import torch

from factory.kernels.choice import KernelChoice
from factory.kernels.mamba_ssm_triton import serves

__all__ = ["OP", "REFERENCE", "conv_kernel", "triton_conv"]

OP = "causal conv"
REFERENCE = "PyTorch shifted multiply-adds"
TRITON = "Triton (factory.kernels.triton_causal_conv)"

Conv = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None], torch.Tensor
]


@functools.cache
def _load() -> Conv | str:
    """The Triton conv, kept out of ``torch.compile``'s graph (a graph break, as for
    mamba_ssm's kernels: tracing the launches is untested), or why it does not import."""
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    try:
        module = importlib.import_module("factory.kernels.triton_causal_conv")
    except Exception as error:  # ImportError, or Triton failing to initialise
        return f"the Triton conv does not import ({type(error).__name__}: {error})"
    return torch.compiler.disable(module.causal_depthwise_conv)


def _choose(device: torch.device | str) -> tuple[Conv | None, str | None]:
    """(the Triton conv, None) where it serves ``device``; (None, why) where it should and
    cannot; (None, None) where the PyTorch path is the choice (CPU)."""
    if not serves(device):
        return None, None
    loaded = _load()
    if isinstance(loaded, str):
        return None, loaded
    return loaded, None


def triton_conv(x: torch.Tensor) -> Conv | None:
    """The Triton conv for ``x`` (``causal_depthwise_conv(x, weight, bias, seq_idx)``), or None
    for the PyTorch path."""
    return _choose(x.device)[0]


def conv_kernel(device: str) -> KernelChoice:
    """Which implementation the mixer's conv runs on ``device`` (the test :func:`triton_conv`
    makes)."""
    kernel, why = _choose(device)
    return KernelChoice(OP, REFERENCE if kernel is None else TRITON, why)
