"""Causal attention over packed documents through FlexAttention, one block mask per step.

FlexAttention (``torch.nn.attention.flex_attention``) runs attention as one fused
kernel that visits only the [128 x 128] tiles a ``BlockMask`` lists: tiles no
query of which sees a key are skipped, *full* tiles (every query sees every key)
run without a mask, and the *partial* ones apply ``mask_mod`` per element. For
causal attention over packed documents that is the block-diagonal band and
nothing else, with no [S, S] mask in memory.

The mask is the same for every attention layer of a step (the documents are the
batch's), so :func:`document_mask` builds it once and hands the same object to
every layer: an eager run keeps the last one, keyed on the ``document_ids``
tensor itself (the model passes one tensor to all its layers). Inside a compiled
block (``training.compile``) the mask's tables are traced into the graph instead,
a few fused elementwise passes over [S / 128] tiles per row, so the graph has no
break and no Python per batch.

The queries may be any runs of positions (context parallelism gives a rank two
chunks of the sequence, ``QueryRun``) while the keys cover the whole sequence:
``mask_mod`` reads each query row's global position and the start of its
document from two tables indexed by the row, padded to a whole 128-row tile, so
it never indexes past them (flex evaluates ``mask_mod`` on a partial last tile's
out-of-range rows too). A query at position ``p`` sees the keys
``[start of p's document, p]``; no key index is ever looked up.

Grouped K/V heads are flex's own (``enable_gqa=True``). Outside a compiled graph
flex must itself be compiled to get the fused kernel (``torch.compile(flex_attention)``,
the documented way); that callable is made once per process
(:func:`compiled_flex_attention`). Inside one, flex is traced into the graph.
"""

from __future__ import annotations

import functools
import importlib.util
import weakref
from collections.abc import Callable

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from factory.kernels.document_attention import QueryRun

__all__ = [
    "TILE",
    "TRITON_IMPORTABLE",
    "build_document_mask",
    "compiled_flex_attention",
    "document_mask",
    "flex_document_attention",
    "flex_unavailable",
]

TILE = 128
"""FlexAttention's default sparse block, rows and columns: the unit the mask lists."""


TRITON_IMPORTABLE = importlib.util.find_spec("triton") is not None
"""Looked up once, at import (without loading it): inside a compiled graph the dispatch reads a
plain constant. (FlexAttention itself is in every torch factory supports.)"""


def flex_unavailable(device: str) -> str | None:
    """Why FlexAttention's fused kernel cannot serve attention on ``device``; None when it can.
    Only CUDA is asked for it: the CPU keeps the reference path (PyTorch has no FlexAttention
    backward on CPU)."""
    if device != "cuda":
        return "FlexAttention is factory's attention kernel on CUDA only, not on " + device
    if not TRITON_IMPORTABLE:
        return "triton is not installed (FlexAttention compiles to Triton on CUDA)"
    return None


def _query_positions(runs: list[QueryRun], rows: int, device: torch.device) -> torch.Tensor:
    """The global position of every local query row, -1 on the rows that pad the last tile."""
    ordered = sorted(runs, key=lambda run: run.local)
    if [r.local for r in ordered] != [
        sum(r.length for r in ordered[:i]) for i in range(len(ordered))
    ]:
        raise ValueError(f"query runs {runs} do not tile the local rows from 0")
    padded = -(-rows // TILE) * TILE
    pieces = [torch.arange(r.start, r.start + r.length, device=device) for r in ordered]
    pieces.append(torch.full((padded - rows,), -1, dtype=torch.int64, device=device))
    return torch.cat(pieces)


def _document_starts(document_ids: torch.Tensor) -> torch.Tensor:
    """[B, S]: the position where the document holding each position starts."""
    length = document_ids.shape[1]
    index = torch.arange(length, device=document_ids.device).expand_as(document_ids)
    boundary = torch.ones_like(document_ids, dtype=torch.bool)
    boundary[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    return torch.where(boundary, index, 0).cummax(dim=1).values


def _kv_tables(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, Qt, Kt] bool -> flex's (count [B, 1, Qt], indices [B, 1, Qt, Kt]) of the set tiles,
    the set ones first in ascending order."""
    count = tiles.sum(-1, dtype=torch.int32)
    indices = torch.argsort((~tiles).to(torch.uint8), dim=-1, stable=True).to(torch.int32)
    return count[:, None], indices[:, None]


def build_document_mask(
    document_ids: torch.Tensor | None,
    runs: list[QueryRun],
    query_rows: int,
    key_length: int,
    device: torch.device,
) -> BlockMask:
    """The causal, same-document ``BlockMask`` of ``query_rows`` local queries placed by
    ``runs`` over ``key_length`` keys (``document_ids`` [B, key_length]; None: one document
    per row, the mask shared by every row). Static shapes only: it traces into a graph."""
    # The rows padding the last tile see nothing: that tile is never full, as
    # create_block_mask finds it too (it evaluates mask_mod on those rows).
    position = _query_positions(runs, query_rows, device)  # [Qp]
    if document_ids is None:
        start = torch.zeros(1, position.shape[0], dtype=torch.int64, device=device)
    else:
        start = _document_starts(document_ids.to(device)).gather(
            1, position.clamp(min=0).expand(document_ids.shape[0], -1)
        )  # [B, Qp]: where each query row's document starts
    first_key = torch.arange(0, key_length, TILE, device=device)
    last_key = (first_key + TILE - 1).clamp(max=key_length - 1)
    row_sees_some = (start[..., None] <= last_key) & (position[:, None] >= first_key)
    row_sees_all = (start[..., None] <= first_key) & (position[:, None] >= last_key)
    shape = (start.shape[0], -1, TILE, first_key.shape[0])  # [B, Qt, rows of a tile, Kt]
    some = row_sees_some.view(shape).any(2)
    full = row_sees_all.view(shape).all(2) & some
    count, indices = _kv_tables(some & ~full)
    full_count, full_indices = _kv_tables(full)

    if document_ids is None:

        def mask_mod(
            b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor
        ) -> torch.Tensor:
            return kv <= position[q]

    else:

        def mask_mod(
            b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor
        ) -> torch.Tensor:
            return (kv <= position[q]) & (kv >= start[b, q])

    return BlockMask.from_kv_blocks(
        count, indices, full_count, full_indices, BLOCK_SIZE=TILE, mask_mod=mask_mod,
        seq_lengths=(query_rows, key_length),
    )  # fmt: skip


class _LastMask:
    """The mask of the last step: its ``document_ids`` (by identity and version) and layout."""

    def __init__(self) -> None:
        self.documents: weakref.ref[torch.Tensor] | None = None
        self.key: tuple[object, ...] | None = None
        self.mask: BlockMask | None = None


_LAST = _LastMask()


def document_mask(
    document_ids: torch.Tensor | None,
    runs: list[QueryRun],
    query_rows: int,
    key_length: int,
    device: torch.device,
) -> BlockMask:
    """:func:`build_document_mask`, built once per step: every attention layer of a step gets
    the same ``document_ids`` tensor and the same query layout, and so the same mask object.
    Inside a compiled graph it comes from outside it (a graph break at
    :func:`_document_mask_outside_the_graph`): the graph takes the mask as an input, built
    once per step for every layer, and new documents recompile nothing."""
    if torch.compiler.is_compiling():
        return _document_mask_outside_the_graph()(
            document_ids, runs, query_rows, key_length, device
        )
    version = None if document_ids is None else document_ids._version
    key = (version, tuple(runs), query_rows, key_length, str(device))
    same_documents = (
        _LAST.documents is None if document_ids is None else (
            _LAST.documents is not None and _LAST.documents() is document_ids
        )
    )  # fmt: skip
    if _LAST.mask is None or not same_documents or _LAST.key != key:
        _LAST.mask = build_document_mask(document_ids, runs, query_rows, key_length, device)
        _LAST.documents = None if document_ids is None else weakref.ref(document_ids)
        _LAST.key = key
    return _LAST.mask


@functools.cache
def _document_mask_outside_the_graph() -> Callable[..., BlockMask]:
    """:func:`document_mask` run eagerly from inside a compiled graph, which then takes the mask
    as an input: torch 2.11's inductor could not lower flex over a mask built inside the graph.
    Made on first use: ``torch.compiler.disable`` imports torch's compiler, which importing
    this module (building a model) must not."""
    return torch.compiler.disable(document_mask)


@functools.cache
def compiled_flex_attention(backend: str = "inductor") -> Callable[..., torch.Tensor]:
    """``torch.compile(flex_attention)``, compiled once per process and ``backend``: eager
    runs call it to get the fused kernel rather than flex's unfused reference."""
    return torch.compile(flex_attention, backend=backend)


def flex_document_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: BlockMask,
    backend: str = "inductor",
) -> torch.Tensor:
    """FlexAttention of ``q`` [B, H, Sq, D] over ``k``, ``v`` [B, Hkv, S, D] under ``mask``
    (:func:`document_mask`): traced into the graph when compiling, else the compiled
    callable of ``backend``."""
    if torch.compiler.is_compiling():
        return flex_attention(q, k, v, block_mask=mask, enable_gqa=True)
    return compiled_flex_attention(backend)(q, k, v, block_mask=mask, enable_gqa=True)
