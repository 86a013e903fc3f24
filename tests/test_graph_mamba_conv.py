"""The Mamba mixer's depthwise causal conv: its written-out backward against conv1d's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from factory.layers.mamba.module import _causal_depthwise_conv, _taps


def reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    document_ids: torch.Tensor | None,
) -> torch.Tensor:
    """``nn.Conv1d(groups=C, padding=K-1)`` truncated to L, one document at a time."""
    if document_ids is None:
        k = weight.shape[-1]
        out = F.conv1d(x.transpose(1, 2), weight, bias, padding=k - 1, groups=x.shape[-1])
        return out[..., : x.shape[1]].transpose(1, 2)
    rows = []
    for row, docs in zip(x, document_ids, strict=True):
        pieces = [reference(row[None, docs == d], weight, bias, None) for d in docs.unique()]
        rows.append(torch.cat(pieces, dim=1))
    return torch.cat(rows)


@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("documents", [False, True])
def test_conv_matches_conv1d_and_gradcheck(with_bias: bool, documents: bool) -> None:
    gen = torch.Generator().manual_seed(3)
    b, length, c, k = 2, 9, 5, 4
    x = torch.randn(b, length, 2 * c, generator=gen, dtype=torch.float64)[..., :c]  # a view
    weight = torch.randn(c, 1, k, generator=gen, dtype=torch.float64)
    bias = torch.randn(c, generator=gen, dtype=torch.float64) if with_bias else None
    document_ids = torch.tensor([[0] * 4 + [1] * 5, [0] * 2 + [1] * 1 + [2] * 6])
    document_ids = document_ids if documents else None

    leaves = [t.clone().requires_grad_() for t in (x, weight, bias) if t is not None]
    ref_leaves = [t.detach().clone().requires_grad_() for t in leaves]
    ours = _causal_depthwise_conv(*leaves[:2], leaves[2] if with_bias else None, document_ids)
    ref = reference(*ref_leaves[:2], ref_leaves[2] if with_bias else None, document_ids)
    torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-12)
    upstream = torch.randn(ours.shape, generator=gen, dtype=torch.float64)
    ours.backward(upstream)
    ref.backward(upstream)
    for a, r in zip(leaves, ref_leaves, strict=True):
        torch.testing.assert_close(a.grad, r.grad, rtol=1e-12, atol=1e-12)

    def fn(*args: torch.Tensor) -> torch.Tensor:
        return _causal_depthwise_conv(*args[:2], args[2] if with_bias else None, document_ids)

    assert torch.autograd.gradcheck(fn, [t.detach().requires_grad_() for t in leaves])


def test_taps_are_contiguous_rows_of_the_weight() -> None:
    """Unit-stride [K, C] taps: what lets inductor vectorise the compiled conv over C."""
    weight = torch.randn(6, 1, 4)
    taps = _taps(weight)
    assert taps.shape == (4, 6) and taps.is_contiguous()
    assert torch.equal(taps, weight[:, 0, :].t())
