"""Block attention over packed documents equals SDPA with the block-diagonal causal mask."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn import functional as F

from factory.kernels.document_attention import (
    QueryRun,
    attention_blocks,
    document_attention,
)

TOL = {"atol": 2e-6, "rtol": 2e-5}


def _reference(q, k, v, document_ids, positions):
    """SDPA over every position with the [S, S] mask, then the query rows at ``positions``."""
    s = k.shape[2]
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    mask = (
        causal
        if document_ids is None
        else causal & (document_ids[:, :, None] == document_ids[:, None, :])
    )
    mask = mask if mask.dim() == 3 else mask.expand(q.shape[0], s, s)
    full_q = q.new_zeros(q.shape[0], q.shape[1], s, q.shape[3])
    full_q[:, :, positions] = q
    out = F.scaled_dot_product_attention(full_q, k, v, attn_mask=mask[:, None], enable_gqa=True)
    return out[:, :, positions]


def _documents(draw, rows: int, length: int) -> torch.Tensor:
    ids = []
    for _ in range(rows):
        cuts = sorted(draw(st.sets(st.integers(1, length - 1), max_size=6)))
        row = torch.zeros(length, dtype=torch.int64)
        for cut in cuts:
            row[cut:] += 1
        ids.append(row)
    return torch.stack(ids)


@st.composite
def _case(draw):
    rows, heads, group = draw(st.integers(1, 2)), draw(st.sampled_from([2, 4])), 2
    chunks = draw(st.sampled_from([1, 2, 4]))  # the context-parallel split of the queries
    length = chunks * 2 * draw(st.integers(2, 6))
    with_docs = draw(st.booleans())
    document_ids = _documents(draw, rows, length) if with_docs else None
    # Head-tail: rank r of `chunks / 2` ranks holds chunks r and chunks-1-r (all when 1).
    size = length // chunks
    if chunks == 1:
        runs = [QueryRun(0, 0, length)]
    else:
        rank = draw(st.integers(0, chunks // 2 - 1))
        runs = [QueryRun(0, rank * size, size), QueryRun(size, (chunks - 1 - rank) * size, size)]
    seed = draw(st.integers(0, 2**16))
    return rows, heads, heads // group, length, document_ids, runs, seed


@settings(max_examples=40, deadline=None)
@given(_case())
def test_blocks_equal_the_masked_attention_and_its_gradients(case) -> None:
    rows, heads, kv_heads, length, document_ids, runs, seed = case
    gen = torch.Generator().manual_seed(seed)
    local = sum(run.length for run in runs)
    positions = torch.cat([torch.arange(r.start, r.start + r.length) for r in runs])
    q = torch.randn(rows, heads, local, 8, generator=gen, requires_grad=True)
    k = torch.randn(rows, kv_heads, length, 8, generator=gen, requires_grad=True)
    v = torch.randn(rows, kv_heads, length, 8, generator=gen, requires_grad=True)
    blocks = attention_blocks(runs, document_ids, rows, length)
    ours = document_attention(q, k, v, blocks)
    theirs = _reference(q, k, v, document_ids, positions)
    torch.testing.assert_close(ours, theirs, **TOL)
    grad = torch.randn(ours.shape, generator=gen)
    got = torch.autograd.grad(ours, (q, k, v), grad)
    want = torch.autograd.grad(theirs, (q, k, v), grad)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, **TOL)


def test_blocks_need_no_mask_and_follow_the_documents() -> None:
    ids = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2]])
    blocks = attention_blocks([QueryRun(0, 0, 8)], ids, 1, 8)
    assert [(b.q, b.k, b.causal) for b in blocks] == [
        (slice(0, 3), slice(0, 3), True),
        (slice(3, 7), slice(3, 7), True),
        (slice(7, 8), slice(7, 8), True),
    ]
    # A query chunk in the middle of a document sees that document's earlier part whole.
    late = attention_blocks([QueryRun(0, 4, 3)], ids, 1, 8)
    assert [(b.q, b.k, b.causal) for b in late] == [
        (slice(0, 3), slice(3, 4), False),
        (slice(0, 3), slice(4, 7), True),
    ]


@pytest.mark.parametrize("dtype", [torch.bfloat16])
def test_reduced_precision_inputs_keep_their_dtype(dtype: torch.dtype) -> None:
    q, k, v = (torch.randn(1, 2, 16, 8, dtype=dtype) for _ in range(3))
    blocks = attention_blocks([QueryRun(0, 0, 16)], None, 1, 16)
    out = document_attention(q, k, v, blocks)
    assert out.dtype == dtype
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
