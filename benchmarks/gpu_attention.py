"""Section 6: document-masked attention, factory's path against SDPA with a dense mask and
FlexAttention.

One attention call of the 1B blueprint's shape (its heads, KV heads and head dim, BF16,
batch 1) over packed documents (lengths drawn with a fixed seed, 2,048 tokens on average,
cut anywhere) at 4,096 and 8,192 tokens, three ways:

* ``factory``: ``factory.layers.attention.module.causal_attention`` with the document ids,
  as the model calls it: ``torch.nn.attention.varlen`` (flash attention over the documents)
  on CUDA where it exists, the mask-free blocks on CPU;
* ``sdpa mask``: SDPA with the [S, S] boolean document-causal mask (the path under
  ``torch.compile`` and on devices with neither of the above);
* ``flex``: ``torch.compile``'d FlexAttention with a document ``BlockMask``.

Reported: each one's largest difference from an fp32 masked reference (over its largest
magnitude), the median forward and forward + backward times. The dry run does it at 128
tokens on CPU, FlexAttention traced with ``aot_eager`` (no code generation).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from benchmarks.gpu_common import SectionContext, median_seconds, table
from benchmarks.long_context import documents

TITLE = "Document-masked attention: varlen/blocks vs SDPA with a mask vs FlexAttention"
BUDGET_S = 50
"""On an H100: FlexAttention's forward and backward compiles at each length (~10 s
each), then milliseconds per call."""

MEAN_DOCUMENT = 2048
TOLERANCE = 2e-2
"""Largest difference from the fp32 reference over its largest magnitude, in BF16."""


def _methods(ids: torch.Tensor, dry_run: bool) -> dict[str, Callable[..., torch.Tensor]]:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from factory.kernels.document_attention import QueryRun
    from factory.layers.attention.module import _masked, causal_attention

    length, doc = ids.shape[1], ids[0]
    block_mask = create_block_mask(lambda b, h, qi, ki: (qi >= ki) & (doc[qi] == doc[ki]),
                                   1, 1, length, length, device=ids.device)  # fmt: skip
    flex = torch.compile(flex_attention, dynamic=False,
                         backend="aot_eager" if dry_run else "inductor")  # fmt: skip
    runs = [QueryRun(0, 0, length)]
    return {
        "factory": lambda q, k, v: causal_attention(q, k, v, ids),
        "sdpa mask": lambda q, k, v: _masked(q, k, v, ids, runs),
        "flex": lambda q, k, v: flex(q, k, v, block_mask=block_mask, enable_gqa=True),
    }


def _forward_backward(
    method: Callable[..., torch.Tensor], qkv: list[torch.Tensor]
) -> list[torch.Tensor]:
    leaves = [t.detach().clone().requires_grad_() for t in qkv]
    out = method(*leaves)
    out.float().square().sum().backward()
    return [out.float(), *(t.grad.float() for t in leaves)]


def measure(ctx: SectionContext, length: int, heads: tuple[int, int, int]) -> dict[str, Any]:
    from factory.kernels.document_attention import QueryRun
    from factory.layers.attention.module import _masked

    h, kv, d = heads
    gen = torch.Generator().manual_seed(0)
    ids = documents(length, MEAN_DOCUMENT if not ctx.dry_run else 16).to(ctx.device)
    qkv = [
        torch.randn(1, n, length, d, generator=gen).to(ctx.device, torch.bfloat16)
        for n in (h, kv, kv)
    ]
    reference = _forward_backward(lambda q, k, v: _masked(q.float(), k.float(), v.float(), ids,
                                                          [QueryRun(0, 0, length)]), qkv)  # fmt: skip
    result: dict[str, Any] = {"documents": int(ids.max()) + 1}
    for name, method in _methods(ids, ctx.dry_run).items():
        # PyTorch has no FlexAttention backward on CPU: there the dry run checks its forward.
        backward = not (name == "flex" and ctx.device.type == "cpu")
        try:
            result[name] = _measure_one(ctx, method, qkv, reference, backward)
        except Exception as error:  # one path failing must not hide the others' figures
            ctx.fail(f"{name} at {length} tokens: {type(error).__name__}: {error}")
            continue
        if result[name]["relative_error"] > TOLERANCE:
            ctx.fail(
                f"{name} at {length} tokens: relative error {result[name]['relative_error']:.3g}"
            )
    return result


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


def run(ctx: SectionContext) -> None:
    if ctx.dry_run:
        heads = (4, 2, 16)
    else:
        from benchmarks.gpu_train import load

        attention = load(False).model.attention
        heads = (attention.heads, attention.kv_heads, attention.head_dim)
    ctx.record("heads", list(heads))
    for length in (128,) if ctx.dry_run else (4096, 8192):
        ctx.record(str(length), measure(ctx, length, heads))


def markdown(results: dict[str, Any]) -> str:
    h, kv, d = results.get("heads", [None] * 3)
    text = (f"{h} query heads, {kv} KV heads, head dim {d}, BF16, batch 1; error: largest "
            "difference from the fp32 masked reference over its largest magnitude\n\n")  # fmt: skip
    rows = []
    for length, r in results.items():
        if not length.isdigit():
            continue
        for name in ("factory", "sdpa mask", "flex"):
            if name in r:
                m = r[name]
                both = m["forward_backward_s"]
                rows.append([int(length), r["documents"], name, m["relative_error"],
                             m["forward_s"] * 1e3, None if both is None else both * 1e3])  # fmt: skip
    return text + table(["tokens", "documents", "path", "error", "fwd ms", "fwd+bwd ms"], rows)
