"""Section 4: the routed experts on the device, ``torch._grouped_mm`` against padded bmm, and
the whole MoE block at Nano's width on the sync-free dispatch.

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

The block part builds Nano's MoE layer (the ``nano`` blueprint: hidden 2688, 128 experts,
top-6, expert ffn 1856, shared expert 3712, sigmoid router with expert bias and the
sequence-wise aux loss) in BF16 at 8192 tokens and times its forward + backward: eager on
the sync-free dispatch (the ``_grouped_mm`` path), eager on the host-synced padded path
(what ran before), and compiled with ``fullgraph=True`` (one graph, so no host sync). Beside
them, its grouped GEMMs alone (the up and down ``_grouped_mm`` over the same routing's
sorted pairs, forward and backward), with their TFLOP/s: how far the block is from its
GEMMs. On CUDA one step also runs under ``torch.cuda.set_sync_debug_mode("error")``, which
raises on any host sync. The dry run builds the proxy width and compiles with aot_eager.
"""

from __future__ import annotations

from typing import Any

import torch

from benchmarks.gpu_common import SectionContext, attempt, median_seconds, table, timed

TITLE = "MoE experts: torch._grouped_mm vs padded bmm; the Nano-width MoE block"
BUDGET_S = 60
"""On an H100: two routings x two paths x 10 timed fwd+bwd calls of a few ms; the block's
compile (tens of seconds) and 3 x 5 timed fwd+bwd calls of tens of ms."""

BLOCK_TOKENS = 8192
"""Tokens of the block part: one 8k sequence (48k routed pairs at top-6)."""

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


def nano_block(dry_run: bool) -> tuple[torch.nn.Module, dict[str, int]]:
    """Nano's MoE layer (its CPU proxy in a dry run) on the CPU, in fp32, and its shape."""
    import factory
    from factory.proxy import derive_proxy
    from factory.spec.layer_type import LAYER_TYPES

    blueprint = factory.load_blueprint("nano")
    if dry_run:
        blueprint = derive_proxy(blueprint, width=64)
    model = blueprint.model
    routed = next(t for t in LAYER_TYPES.values() if t.routes_experts)
    torch.manual_seed(0)
    module = routed.build(model)
    for name, p in module.named_parameters():
        if p.requires_grad:  # the initialisation's scale, not its exact law
            torch.nn.init.normal_(p, std=0.02 if "gate" not in name else 0.01)
    moe = model.moe
    s = {"tokens": 64 if dry_run else BLOCK_TOKENS, "hidden": model.hidden_size,
         "experts": moe.num_experts, "top_k": moe.top_k, "ff": moe.expert_intermediate_size,
         "d": moe.latent_size or model.hidden_size}  # fmt: skip
    return module, s


def _block_step(module: torch.nn.Module, x: torch.Tensor) -> None:
    out = module(x)
    (out.y.float().square().mean() + out.aux_loss).backward()


def _gemms_alone(block: torch.nn.Module, x: torch.Tensor) -> Any:
    """The block's up and down ``_grouped_mm`` over its routing's sorted pairs, forward and
    backward, and their FLOPs (3 x 2 x pairs x d x ff per projection)."""
    from factory.kernels.moe_dispatch import gather_pairs, route_tokens

    flat = x.reshape(-1, x.shape[-1])
    with torch.no_grad():
        _, indices, _ = block.gate(flat)
        dispatch = route_tokens(indices, block.cfg.num_experts, check=False)
        xs = gather_pairs(flat, dispatch).detach().requires_grad_()
    experts = block.experts
    up, down = experts.up_proj, experts.down_proj
    offsets = dispatch.offsets
    pairs, (_, ff, d) = xs.shape[0], up.shape
    flops = 3 * 2 * 2 * pairs * d * ff

    def step() -> None:
        h = torch._grouped_mm(xs, up.transpose(1, 2), offs=offsets)
        y = torch._grouped_mm(h, down.transpose(1, 2), offs=offsets)
        y.backward(torch.ones_like(y))

    return step, flops


def block(ctx: SectionContext) -> dict[str, Any]:
    """The Nano-width MoE block's forward + backward: sync-free eager, padded eager, compiled,
    and its grouped GEMMs alone."""
    device, dtype = ctx.device, torch.bfloat16
    module, s = nano_block(ctx.dry_run)
    module = module.to(device, dtype).train()
    module.gate.float()  # the router stays in fp32, as factory.compile keeps it
    result: dict[str, Any] = {"shape": s, "sync_free": module.sync_free()}
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, s["tokens"], s["hidden"], generator=gen).to(device, dtype)
    repeats, warmup = (1, 0) if ctx.dry_run else (5, 1)
    timings: dict[str, float] = {}
    module.experts.path = "padded_bmm"
    timings["eager, padded bmm (host-synced)"] = median_seconds(
        lambda: _block_step(module, x), device, repeats, warmup
    )
    module.experts.path = None
    if not result["sync_free"]:
        ctx.fail("the MoE block has no sync-free path here: nothing more to time")
        result["seconds"] = timings
        return result
    timings["eager, sync-free"] = median_seconds(
        lambda: _block_step(module, x), device, repeats, warmup
    )
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            _block_step(module, x)
            result["host_syncs"] = "none"
        except RuntimeError as error:
            result["host_syncs"] = str(error).splitlines()[0]
            ctx.fail(f"the sync-free block synchronized: {result['host_syncs']}")
        finally:
            torch.cuda.set_sync_debug_mode("default")
    backend = "aot_eager" if ctx.dry_run else "inductor"
    compiled = torch.compile(module, fullgraph=True, dynamic=False, backend=backend)
    compile_s = timed(lambda: _block_step(compiled, x), device)
    timings[f"compiled ({backend}, fullgraph)"] = median_seconds(
        lambda: _block_step(compiled, x), device, repeats, warmup
    )
    gemms, flops = _gemms_alone(module, x)
    gemm_s = median_seconds(gemms, device, repeats, warmup)
    timings["grouped GEMMs alone"] = gemm_s
    result.update(seconds=timings, compile_s=compile_s, gemm_tflops=flops / gemm_s / 1e12)
    return result


def run(ctx: SectionContext) -> None:
    s = shape(ctx.dry_run)
    ctx.record("shape", s)
    for name, skewed in (("balanced", False), ("skewed", True)):
        ctx.record(name, compare(ctx, s, skewed))
    attempt(ctx, "MoE block", lambda: ctx.record("block", block(ctx)))


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
    text += table(["routing", "load max/mean", "path", "error", "fwd+bwd ms"], rows)
    b = results.get("block")
    if b is None:
        return text
    s = b["shape"]
    text += (f"\nThe MoE block at Nano's width: {s['tokens']} tokens, hidden {s['hidden']}, "
             f"{s['experts']} experts, top-{s['top_k']}, expert ffn {s['ff']}, BF16, forward + "
             f"backward; host syncs on the sync-free path: {b.get('host_syncs', 'n/a')}; "
             f"compile {b.get('compile_s', 0):.1f} s; grouped GEMMs alone at "
             f"{b.get('gemm_tflops', 0):.1f} TFLOP/s\n\n")  # fmt: skip
    gemm = b["seconds"].get("grouped GEMMs alone")
    rows = [[name, seconds * 1e3, seconds / gemm if gemm else None]
            for name, seconds in b["seconds"].items()]  # fmt: skip
    return text + table(["block path", "fwd+bwd ms", "x GEMMs alone"], rows)
