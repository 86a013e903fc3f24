"""Packed documents stay apart: a packed row's logits equal each document's logits run alone.

Covers Mamba (conv window and SSD state), attention, MoE, dense MLP and MTP
layers (the MTP block itself holds a Mamba layer here), with SSD chunk sizes
that do and do not divide the document lengths.
"""

from __future__ import annotations

import pytest
import torch
from blueprint_factory import make

import factory
from factory.graph.loss import language_model_loss
from factory.kernels.document_attention import QueryRun
from factory.layers.attention.module import VARLEN_IMPORTABLE, _masked, _varlen_documents
from factory.nn.packed_documents import document_ids_from_cu_seqlens, same_document

LENGTHS = [[7, 12, 5, 8], [16, 16], [32]]
SEQ = 32


def _model(chunk: int) -> torch.nn.Module:
    bp = make(**{"model.pattern": "M*ME-M*ME/M*E/M*E", "model.mamba.chunk_size": chunk})
    return factory.compile(bp, seed=0, precision="off").model.eval()


def _cu(lengths: list[int]) -> list[int]:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


def test_document_ids_follow_cu_seqlens_and_pad_as_their_own_document() -> None:
    ids = document_ids_from_cu_seqlens([[0, 3, 5], [0, 2, 4]], 6)
    assert ids.tolist() == [[0, 0, 0, 1, 1, 2], [0, 0, 1, 1, 2, 2]]
    assert same_document(ids, 1).tolist()[0] == [True, True, False, True, False]


@pytest.mark.parametrize("chunk", [4, 5, 16])
def test_packed_logits_equal_each_document_alone(chunk: int) -> None:
    model = _model(chunk)
    generator = torch.Generator().manual_seed(chunk)
    ids = torch.randint(0, 1024, (len(LENGTHS), SEQ), generator=generator)
    docs = document_ids_from_cu_seqlens([_cu(row) for row in LENGTHS], SEQ)
    with torch.no_grad():
        packed = model(ids, docs)
        for row, lengths in enumerate(LENGTHS):
            for start, end in zip(_cu(lengths)[:-1], _cu(lengths)[1:], strict=True):
                alone = model(ids[row : row + 1, start:end])
                torch.testing.assert_close(
                    packed.logits[row, start:end], alone.logits[0], atol=2e-5, rtol=1e-4
                )
                for depth, (p, a) in enumerate(
                    zip(packed.mtp_logits, alone.mtp_logits, strict=True), start=1
                ):
                    # Depth k at position i predicts token i+k+1: compare where that token
                    # is still in the document (the rest is never a target).
                    valid = end - start - depth - 1
                    if valid > 0:
                        torch.testing.assert_close(
                            p[row, start : start + valid], a[0, :valid], atol=2e-5, rtol=1e-4
                        )


def test_unpacked_run_differs_so_the_test_has_teeth() -> None:
    model = _model(4)
    ids = torch.randint(0, 1024, (1, SEQ), generator=torch.Generator().manual_seed(1))
    docs = document_ids_from_cu_seqlens([_cu([7, 25])], SEQ)
    with torch.no_grad():
        isolated = model(ids, docs).logits[0, 7:]
        leaking = model(ids).logits[0, 7:]
    assert (isolated - leaking).abs().max() > 1e-3


def test_loss_takes_no_target_across_a_boundary() -> None:
    model = _model(4)
    ids = torch.randint(0, 1024, (1, SEQ), generator=torch.Generator().manual_seed(2))
    docs = document_ids_from_cu_seqlens([_cu([10, 22])], SEQ)
    with torch.no_grad():
        out = model(ids, docs)
        packed = language_model_loss(out, ids, mtp_loss_scale=0.3, document_ids=docs)
        first = model(ids[:, :10])
        second = model(ids[:, 10:])
    lm = torch.nn.functional.cross_entropy(
        torch.cat([first.logits[0, :-1], second.logits[0, :-1]]),
        torch.cat([ids[0, 1:10], ids[0, 11:]]),
    )
    torch.testing.assert_close(packed.lm, lm, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (varlen attention)")
@pytest.mark.skipif(not VARLEN_IMPORTABLE, reason="this torch has no torch.nn.attention.varlen")
def test_varlen_documents_equal_the_masked_path_on_cuda() -> None:
    # varlen is CUDA_DOCUMENT_KERNEL's option, not the default (FlexAttention's test:
    # tests/test_attention_flex.py), so it is called directly.
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(2, 4, 64, 16, device="cuda", generator=gen, dtype=torch.bfloat16)
    k = torch.randn(2, 2, 64, 16, device="cuda", generator=gen, dtype=torch.bfloat16)
    v = torch.randn(2, 2, 64, 16, device="cuda", generator=gen, dtype=torch.bfloat16)
    ids = torch.zeros(2, 64, dtype=torch.int64, device="cuda")
    ids[0, 20:], ids[1, 7:], ids[1, 40:] = 1, 1, 2
    runs = [QueryRun(0, 0, 64)]
    torch.testing.assert_close(
        _varlen_documents(q, k, v, ids), _masked(q, k, v, ids, runs), atol=2e-2, rtol=2e-2
    )
