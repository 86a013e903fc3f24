"""Tile-wise random Hadamard transform (``docs/precision.md``, 'Random Hadamard transform')."""

from __future__ import annotations

import pytest
import torch

from factory.kernels.hadamard import hadamard_matrix, random_signs, rht, rht_inverse


def test_hadamard_is_normalized_sylvester_and_orthogonal() -> None:
    h = hadamard_matrix(16)
    assert h.dtype == torch.float32 and h.shape == (16, 16)
    assert h.abs().eq(0.25).all()
    assert torch.equal(h, h.T)
    assert torch.equal(h @ h.T, torch.eye(16))
    h8 = hadamard_matrix(8) * 8**0.5
    assert torch.equal((h * 4)[:8, :8], h8.round()) and torch.equal((h * 4)[8:, 8:], -h8.round())
    with pytest.raises(ValueError):
        hadamard_matrix(12)


def test_random_signs_seeded() -> None:
    s = random_signs(16, seed=5)
    assert s.dtype == torch.float32 and s.abs().eq(1).all()
    assert torch.equal(s, random_signs(16, seed=5))
    assert not torch.equal(random_signs(16, seed=0), random_signs(16, seed=1))


def test_rht_is_tilewise_rotation_and_invertible() -> None:
    signs = random_signs(16, seed=3)
    m = torch.diag(signs) @ hadamard_matrix(16)
    assert torch.equal(m @ m.T, torch.eye(16))
    gen = torch.Generator().manual_seed(0)
    ints = torch.randint(-8, 9, (5, 48), generator=gen).float()
    out = rht(ints, signs)
    assert torch.equal(out[:, 16:32], ints[:, 16:32] @ m)
    assert torch.equal(rht_inverse(out, signs), ints)  # exact: entries are multiples of 1/16
    x = torch.randn(3, 4, 32, generator=gen)
    torch.testing.assert_close(rht_inverse(rht(x, signs), signs), x, rtol=0, atol=1e-6)
    torch.testing.assert_close(rht(x).norm(), x.norm())


def test_rht_along_other_dim_and_dtype() -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(32, 7, generator=gen)
    signs = random_signs(16, seed=2)
    assert torch.equal(rht(x, signs, along=0), rht(x.T.contiguous(), signs).T)
    assert rht(x.to(torch.bfloat16), signs, along=0).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="multiple of 16"):
        rht(x, signs, along=1)
    with pytest.raises(ValueError, match="signs"):
        rht(x, torch.full((16,), 2.0), along=0)
