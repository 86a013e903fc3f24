"""Random Hadamard transform (RHT) applied tile-wise.

The NVFP4 recipe (arXiv:2509.25149, section 4.2 and appendix C; ``docs/precision.md``,
'Random Hadamard transform') rotates the inputs of weight-gradient GEMMs by
``M = diag(s) @ H`` before quantizing: ``H`` is the normalized Sylvester Hadamard
matrix of size 16 and ``s`` a fixed random ±1 vector shared by all layers. Every run
of 16 consecutive elements along the chosen dimension is multiplied on the right by
``M``. ``M`` is orthogonal (``M @ M.T = I``), so :func:`rht_inverse` (right-multiplication by
``M.T = H @ diag(s)``) undoes it. Arithmetic is fp32; the result has the input's
dtype (so a BF16 input is rounded to BF16, as TE does).
"""

from __future__ import annotations

import functools
import math

import torch

__all__ = ["hadamard_matrix", "random_signs", "rht", "rht_inverse"]

_TILE = 16


def hadamard_matrix(n: int = _TILE) -> torch.Tensor:
    """Normalized Sylvester Hadamard matrix ``H_n = H_2 ⊗ H_{n/2} / sqrt(2)``, fp32 [n, n].

    ``H @ H.T == I`` (exactly for n = 16, whose entries are ±1/4).
    """
    return _hadamard(n).clone()  # callers may write to theirs; the cached one stays intact


@functools.lru_cache(maxsize=8)
def _hadamard(n: int) -> torch.Tensor:
    """Built once per size: every quantized wgrad rotates two operands with it."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"Hadamard size must be a power of two, got {n}")
    h = torch.ones(1, 1, dtype=torch.float64)
    h2 = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.kron(h2, h)
    return (h / math.sqrt(n)).to(torch.float32)


def random_signs(n: int = _TILE, seed: int = 0) -> torch.Tensor:
    """A ±1 fp32 vector of length ``n`` drawn from a ``torch.Generator`` seeded with ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    bits = torch.randint(0, 2, (n,), generator=gen)
    return (bits * 2 - 1).to(torch.float32)


def _rotation(signs: torch.Tensor | None) -> torch.Tensor:
    """``diag(signs) @ H_16`` (just ``H_16`` without signs)."""
    h = _hadamard(_TILE)
    if signs is None:
        return h
    signs = signs.to(torch.float32).reshape(-1)
    if signs.shape != (_TILE,) or not bool((signs.abs() == 1).all()):
        raise ValueError(f"signs must be {_TILE} values of ±1")
    return signs[:, None] * h


def _apply(x: torch.Tensor, m: torch.Tensor, along: int) -> torch.Tensor:
    """Right-multiply every 16-element run of ``x`` along dim ``along`` by ``m``."""
    if x.ndim == 0:
        raise ValueError("rht needs at least one dimension")
    along = along % x.ndim
    if x.shape[along] % _TILE:
        raise ValueError(f"size {x.shape[along]} of dim {along} is not a multiple of {_TILE}")
    # One [n, 16] @ [16, 16] GEMM over a contiguous copy: a batched matmul over a
    # transposed view (the wgrad operands) would run one small GEMM per row.
    moved = x.movedim(along, -1).to(torch.float32).contiguous()
    out = (moved.reshape(-1, _TILE) @ m).reshape(moved.shape)
    return out.movedim(-1, along).to(x.dtype)


def rht(x: torch.Tensor, signs: torch.Tensor | None = None, along: int = -1) -> torch.Tensor:
    """Tile-wise random Hadamard transform: ``x_tile @ (diag(signs) @ H)`` along ``along``."""
    return _apply(x, _rotation(signs), along)


def rht_inverse(
    x: torch.Tensor, signs: torch.Tensor | None = None, along: int = -1
) -> torch.Tensor:
    """Inverse of :func:`rht`: ``x_tile @ (H @ diag(signs))``, the transpose of its rotation."""
    return _apply(x, _rotation(signs).T, along)
