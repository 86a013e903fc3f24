"""Section 6: attention over packed documents, every path factory has, at Nano's head shapes.

One attention call of Nano's shape (``blueprints/nano.yaml``: 32 query heads, 2 KV heads,
head dim 128; BF16, batch 1) over packed documents (lengths drawn with a fixed seed, 2,048
tokens on average, cut anywhere) at 4,096 and 8,192 tokens, each path forward and forward +
backward:

* ``factory``: ``factory.layers.attention.module.causal_attention`` as an eager model calls
  it (FlexAttention on CUDA, :data:`~factory.layers.attention.module.CUDA_DOCUMENT_KERNEL`;
  the mask-free blocks on CPU);
* ``flex``: the eager FlexAttention path itself, ``torch.compile(flex_attention)`` under the
  step's cached document ``BlockMask`` (``factory.kernels.flex_documents``);
* ``flex compiled block``: the same call traced inside a compiled function, as a compiled
  block (``training.compile``) runs it, the mask's tables built in the graph on every call;
* ``varlen``: ``torch.nn.attention.varlen`` over the documents (flash attention; CUDA only),
  the option ``CUDA_DOCUMENT_KERNEL = "varlen"`` picks for eager runs;
* ``sdpa mask``: SDPA with the [S, S] boolean document-causal mask (the fallback).

Reported: each one's largest difference from an fp32 masked reference (over its largest
magnitude), the median forward and forward + backward times, the time to build the block
mask once, and which path is fastest: the table that decides ``CUDA_DOCUMENT_KERNEL``
(FlexAttention today, from issue 38's 4.9x / 2.3x over the masked SDPA at 8k; varlen
was not timed against it then). The dry run does it at 256 tokens and 4 / 2 / 16 heads on CPU, FlexAttention
traced with ``aot_eager`` (no code generation) and forward only (PyTorch has no
FlexAttention backward on CPU), varlen absent.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from benchmarks.gpu_common import SectionContext, median_seconds, table
from benchmarks.long_context import documents

TITLE = "Document-masked attention at Nano's heads: FlexAttention vs varlen vs SDPA with a mask"
BUDGET_S = 100
"""On an H100: FlexAttention's forward and backward compile at each length, eager and in a
compiled function (~10 s each), then milliseconds per call."""

MEAN_DOCUMENT = 2048
TOLERANCE = 2e-2
"""Largest difference from the fp32 reference over its largest magnitude, in BF16."""
PATHS = ("factory", "flex", "flex compiled block", "varlen", "sdpa mask")


def _methods(ids: torch.Tensor, dry_run: bool) -> dict[str, Callable[..., torch.Tensor] | None]:
    """Every path, None where this device has none (varlen off CUDA)."""
    from factory.kernels.document_attention import QueryRun
    from factory.kernels.flex_documents import (
        document_mask,
        flex_document_attention,
    )
    from factory.layers.attention.module import (
        VARLEN_IMPORTABLE,
        _masked,
        _varlen_documents,
        causal_attention,
    )

    length = ids.shape[1]
    runs = [QueryRun(0, 0, length)]
    backend = "aot_eager" if dry_run else "inductor"

    def eager_flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        mask = document_mask(ids, runs, q.shape[2], length, q.device)
        return flex_document_attention(q, k, v, mask, backend=backend)

    def in_a_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        mask = document_mask(ids, runs, q.shape[2], length, q.device)  # as the model's blocks
        return flex_document_attention(q, k, v, mask)

    varlen = ids.device.type == "cuda" and VARLEN_IMPORTABLE
    return {
        "factory": lambda q, k, v: causal_attention(q, k, v, ids),
        "flex": eager_flex,
        "flex compiled block": torch.compile(in_a_block, backend=backend, dynamic=False),
        "varlen": (lambda q, k, v: _varlen_documents(q, k, v, ids)) if varlen else None,
        "sdpa mask": lambda q, k, v: _masked(q, k, v, ids, runs),
    }


def _forward_backward(
    method: Callable[..., torch.Tensor], qkv: list[torch.Tensor]
) -> list[torch.Tensor]:
    leaves = [t.detach().clone().requires_grad_() for t in qkv]
    out = method(*leaves)
    out.float().square().sum().backward()
    return [out.float(), *(t.grad.float() for t in leaves)]


def _mask_seconds(ctx: SectionContext, ids: torch.Tensor, repeats: int) -> float:
    """Building the step's block mask once (eager, outside any graph)."""
    from factory.kernels.document_attention import QueryRun
    from factory.kernels.flex_documents import build_document_mask

    length = ids.shape[1]
    runs = [QueryRun(0, 0, length)]
    return median_seconds(
        lambda: build_document_mask(ids, runs, length, length, ctx.device), ctx.device, repeats
    )


def measure(ctx: SectionContext, length: int, heads: tuple[int, int, int]) -> dict[str, Any]:
    from factory.kernels.document_attention import QueryRun
    from factory.layers.attention.module import _masked

    h, kv, d = heads
    gen = torch.Generator().manual_seed(0)
    ids = documents(length, MEAN_DOCUMENT if not ctx.dry_run else 64).to(ctx.device)
    qkv = [
        torch.randn(1, n, length, d, generator=gen).to(ctx.device, torch.bfloat16)
        for n in (h, kv, kv)
    ]
    reference = _forward_backward(lambda q, k, v: _masked(q.float(), k.float(), v.float(), ids,
                                                          [QueryRun(0, 0, length)]), qkv)  # fmt: skip
    result: dict[str, Any] = {"documents": int(ids.max()) + 1}
    result["mask_build_s"] = _mask_seconds(ctx, ids, 1 if ctx.dry_run else 10)
    for name, method in _methods(ids, ctx.dry_run).items():
        if method is None:
            result[name] = "not available"
            continue
        # PyTorch has no FlexAttention backward on CPU: there the dry run checks its forward.
        backward = not (name.startswith("flex") and ctx.device.type == "cpu")
        try:
            result[name] = _measure_one(ctx, method, qkv, reference, backward)
        except Exception as error:  # one path failing must not hide the others' figures
            ctx.fail(f"{name} at {length} tokens: {type(error).__name__}: {error}")
            continue
        if result[name]["relative_error"] > TOLERANCE:
            ctx.fail(
                f"{name} at {length} tokens: relative error {result[name]['relative_error']:.3g}"
            )
    result["fastest"] = _fastest(result)
    return result


def _fastest(result: dict[str, Any]) -> dict[str, str | None]:
    """The fastest path forward, and forward + backward, among those measured."""
    measured = {n: m for n, m in result.items() if n in PATHS and isinstance(m, dict)}
    fastest: dict[str, str | None] = {}
    for key in ("forward_s", "forward_backward_s"):
        timed = {n: m[key] for n, m in measured.items() if m[key] is not None}
        fastest[key] = min(timed, key=timed.__getitem__) if timed else None
    return fastest


def _measure_one(ctx: SectionContext, method: Callable[..., torch.Tensor], qkv: list[torch.Tensor],
                 reference: list[torch.Tensor], backward: bool) -> dict[str, Any]:  # fmt: skip
    repeats = 1 if ctx.dry_run else 10
    if backward:
        got = _forward_backward(method, qkv)
    else:
        with torch.no_grad():
            got, reference = [method(*qkv).float()], reference[:1]
    error = max(
        float((a - b).abs().max() / b.abs().max()) for a, b in zip(got, reference, strict=True)
    )
    with torch.no_grad():
        forward = median_seconds(lambda: method(*qkv), ctx.device, repeats)
    both = (
        median_seconds(lambda: _forward_backward(method, qkv), ctx.device, repeats)
        if backward
        else None
    )
    return {"relative_error": error, "forward_s": forward, "forward_backward_s": both}


def nano_heads() -> tuple[int, int, int]:
    """Nano's attention: query heads, KV heads, head dim."""
    from factory.loading.blueprint import read_blueprint, resolve_source

    attention = read_blueprint(resolve_source("nano"))[0].model.attention
    return attention.heads, attention.kv_heads, attention.head_dim


def run(ctx: SectionContext) -> None:
    from factory.layers.attention.module import CUDA_DOCUMENT_KERNEL

    heads = nano_heads()  # read in the dry run too, which then runs at a tiny shape
    ctx.record("nano_heads", list(heads))
    heads = (4, 2, 16) if ctx.dry_run else heads
    ctx.record("heads", list(heads))
    ctx.record("cuda_default", CUDA_DOCUMENT_KERNEL)
    for length in (256,) if ctx.dry_run else (4096, 8192):
        ctx.record(str(length), measure(ctx, length, heads))


def markdown(results: dict[str, Any]) -> str:
    h, kv, d = results.get("heads", [None] * 3)
    shape = "Nano" if results.get("heads") == results.get("nano_heads") else "not Nano's"
    text = (f"{h} query heads, {kv} KV heads, head dim {d} ({shape}), BF16, batch 1; error: "
            "largest difference from the fp32 masked reference over its largest magnitude; "
            f"CUDA's default: {results.get('cuda_default')}\n\n")  # fmt: skip
    rows, verdicts = [], []
    for length, r in results.items():
        if not length.isdigit():
            continue
        for name in PATHS:
            m = r.get(name)
            if m == "not available":
                rows.append([int(length), r["documents"], name, None, None, None])
            elif isinstance(m, dict):
                both = m["forward_backward_s"]
                rows.append([int(length), r["documents"], name, m["relative_error"],
                             m["forward_s"] * 1e3, None if both is None else both * 1e3])  # fmt: skip
        fastest = r.get("fastest", {})
        verdicts.append(
            f"- {length} tokens: block mask built in {r['mask_build_s'] * 1e3:.3g} ms; fastest "
            f"forward {fastest.get('forward_s')}, forward + backward "
            f"{fastest.get('forward_backward_s')}"
        )
    header = ["tokens", "documents", "path", "error", "fwd ms", "fwd+bwd ms"]
    return text + table(header, rows) + "\n\n" + "\n".join(verdicts) + "\n"
