"""Section 4: the routed experts on the device, ``torch._grouped_mm`` against padded bmm.

Both paths of ``factory.kernels.moe_dispatch.grouped_mlp`` (``impl="grouped_mm"``: one
ragged GEMM per projection over the experts' runs; ``impl="bmm"``: the pairs copied into an
[E, max load, d] zero-padded buffer and a batched GEMM) run the 1B blueprint's MoE layer
shape in BF16: its micro-batch x seq_len tokens, LatentMoE's latent width, squared-ReLU
experts, top-k weights. Two routings: balanced (uniform random scores) and skewed (scores
plus an expert bias of 0.5**e, as a trained router's favourites; the padded path then
multiplies up to E/k times the rows). For each path: the output and the gradients of the
input, both weights and the routing weights against an fp32 per-expert reference (largest
difference over the reference's largest magnitude), and the median forward + backward
time. In a dry run on CPU the same runs at a tiny shape; where ``_grouped_mm`` does not
work on this build it is recorded as not available and the padded path still runs.
"""

from __future__ import annotations

from typing import Any

import torch

from benchmarks.gpu_common import SectionContext, median_seconds, table

TITLE = "MoE experts: torch._grouped_mm vs padded bmm"
BUDGET_S = 30
"""On an H100: two routings x two paths x 10 timed fwd+bwd calls of a few ms."""

TOLERANCE = 5e-2
"""Largest difference from the fp32 reference over its largest magnitude, in BF16."""


def shape(dry_run: bool) -> dict[str, int]:
    """The 1B blueprint's MoE layer at its batch (tokens, experts, k, latent width, ff)."""
    if dry_run:
        return {"tokens": 64, "experts": 8, "top_k": 2, "d": 32, "ff": 48}
    from benchmarks.gpu_train import batch_shape, load

    bp = load(False)
    moe, (batch, seq) = bp.model.moe, batch_shape(bp, False)
    return {"tokens": batch * seq, "experts": moe.num_experts, "top_k": moe.top_k,
            "d": moe.latent_size or bp.model.hidden_size, "ff": moe.expert_intermediate_size}  # fmt: skip


def routing(
    s: dict[str, int], skewed: bool, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k expert indices [T, k] and their normalized sigmoid weights [T, k]."""
    scores = torch.randn(s["tokens"], s["experts"], generator=gen)
    if skewed:
        scores = scores + 4.0 * 0.5 ** torch.arange(s["experts"])
    weights, index = torch.sigmoid(scores).topk(s["top_k"], dim=1)
    return index, weights / weights.sum(1, keepdim=True)


def reference(x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, up: torch.Tensor,
              down: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """Per expert in fp32: y_t = sum_j w_tj * down_e relu(up_e x_t)^2."""
    y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for expert in range(up.shape[0]):
        token, slot = (index == expert).nonzero(as_tuple=True)
        h = torch.relu(x[token].float() @ up[expert].float().T).square()
        y.index_add_(0, token, weights[token, slot, None].float() * (h @ down[expert].float().T))
    return y


def _outputs(fn: Any, leaves: list[torch.Tensor]) -> list[torch.Tensor]:
    """Output and the gradients of ``leaves`` for the loss sum(y * probe)."""
    leaves = [t.detach().clone().requires_grad_() for t in leaves]
    y = fn(*leaves)
    probe = torch.linspace(-1, 1, y.numel(), device=y.device).view_as(y)
    (y.float() * probe).sum().backward()
    return [y.float(), *(t.grad.float() for t in leaves)]


def _relative(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(
        float((x - y).abs().max() / y.abs().max().clamp_min(1e-30))
        for x, y in zip(a, b, strict=True)
    )


def compare(ctx: SectionContext, s: dict[str, int], skewed: bool) -> dict[str, Any]:
    """Both paths on one routing: differences from the reference and median seconds."""
    from factory.kernels.moe_dispatch import (
        ExpertWeights,
        grouped_mlp,
        grouped_mm_works,
        route_tokens,
    )

    device, dtype = ctx.device, torch.bfloat16
    gen = torch.Generator().manual_seed(1 if skewed else 0)
    index, weights = routing(s, skewed, gen)
    dispatch = route_tokens(index.to(device), s["experts"])
    load = dispatch.tokens_per_expert.float()
    x = torch.randn(s["tokens"], s["d"], generator=gen).to(device, dtype)
    up = (torch.randn(s["experts"], s["ff"], s["d"], generator=gen) / s["d"] ** 0.5).to(
        device, dtype
    )
    down = (torch.randn(s["experts"], s["d"], s["ff"], generator=gen) / s["ff"] ** 0.5).to(
        device, dtype
    )
    leaves = [x, up, down, weights.to(device, torch.float32)]
    expected = _outputs(lambda x, u, d, w: reference(x, index.to(device), w, u, d), leaves)
    result: dict[str, Any] = {"load_max_over_mean": float(load.max() / load.mean())}
    available = grouped_mm_works(device, dtype)
    for impl in ("grouped_mm", "bmm"):
        if impl == "grouped_mm" and not available:
            result[impl] = "not available"
            continue

        def fn(
            x: torch.Tensor, u: torch.Tensor, d: torch.Tensor, w: torch.Tensor, impl: str = impl
        ) -> torch.Tensor:
            return grouped_mlp(x, dispatch, ExpertWeights(u, d), weights=w, impl=impl)

        error = _relative(_outputs(fn, leaves), expected)
        seconds = median_seconds(lambda fn=fn: _outputs(fn, leaves), device,
                                 repeats=1 if ctx.dry_run else 10)  # fmt: skip
        result[impl] = {"relative_error": error, "fwd_bwd_s": seconds}
        if error > TOLERANCE:
            ctx.fail(f"{impl}, {'skewed' if skewed else 'balanced'}: relative error {error:.3g}")
    return result


def run(ctx: SectionContext) -> None:
    s = shape(ctx.dry_run)
    ctx.record("shape", s)
    for name, skewed in (("balanced", False), ("skewed", True)):
        ctx.record(name, compare(ctx, s, skewed))


def markdown(results: dict[str, Any]) -> str:
    s = results.get("shape", {})
    text = (f"{s.get('tokens')} tokens, {s.get('experts')} experts, top-{s.get('top_k')}, "
            f"d {s.get('d')}, ff {s.get('ff')}, BF16; error: largest difference from the fp32 "
            "reference (output and gradients) over its largest magnitude\n\n")  # fmt: skip
    rows = []
    for routing_name in ("balanced", "skewed"):
        r = results.get(routing_name)
        if r is None:
            continue
        for impl in ("grouped_mm", "bmm"):
            p = r[impl]
            if isinstance(p, str):
                rows.append([routing_name, r["load_max_over_mean"], impl, p, None])
            else:
                rows.append([routing_name, r["load_max_over_mean"], impl, p["relative_error"],
                             p["fwd_bwd_s"] * 1e3])  # fmt: skip
    return text + table(["routing", "load max/mean", "path", "error", "fwd+bwd ms"], rows)
