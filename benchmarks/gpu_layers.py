"""Section ``layers``: each layer type of the Nano-width slice, one block forward + backward at
the slice's shapes, against its kernel alone and against the GEMM floor of its FLOPs.

The blocks are those of the slice's model (``benchmarks/blueprints/gpu_nano_slice.yaml``
with the pattern ``M*E``: one block per layer type), built by ``factory.compile`` in BF16,
on one micro-batch of the slice (1 x 8192, ``DOCUMENTS`` packed documents) of random hidden
states, timed eager and then with ``compile_blocks`` (what ``training.compile`` does; a
block whose layer type has no static shapes stays eager, and the row says so). Each
layer's kernel, alone on the tensors the layer hands it, through the same public entry
points the layers call, so the figures follow whatever kernel those dispatch to:

- Mamba (``M``): the SSD scan, ``factory.kernels.ssd.ssd_chunked_scan`` (mamba_ssm's
  ``mamba_chunk_scan_combined`` where it imports), packed documents as ``seq_idx``;
- attention (``*``): ``causal_attention`` (the layer's dispatch) with the documents, and
  FlexAttention with a document block mask (compiled on CUDA, eager in a dry run);
- MoE (``E``): the routed experts' grouped GEMMs on the pairs sorted by expert
  (``factory.kernels.moe_dispatch.grouped_mm_sorted``, ``torch._grouped_mm``), balanced
  top-k routing; the shared expert and the router are not in it.

The GEMM floor of a layer: its training FLOPs by the plan's exact count (per layer type,
over the blocks of that type) at the ``torch.mm`` BF16 rate measured here, on a square
``MM_EDGE`` product. Reported: seconds of each and the ratios, the block over each kernel
(issue 38's goal: within 1.5x of its kernel) and over its floor. The dry run does all of it
on the slice's CPU proxy.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from benchmarks.gpu_common import SectionContext, attempt, median_seconds, table
from benchmarks.gpu_nano_slice import DOCUMENTS, load, packed_documents, step_shape

TITLE = "Per layer type: block vs its kernel alone vs the GEMM floor (Nano-width slice)"
BUDGET_S = 160
"""On an H100: one model of three blocks plus the slice's embedding and head (~3 s), the
torch.mm rate, each block and kernel timed (10 calls each; the first call of a Triton kernel
autotunes), the compile of the Mamba and attention blocks and of FlexAttention (~40-60 s)."""

PATTERN = "M*E"
MM_EDGE, DRY_MM_EDGE = 8192, 256
GOAL_OVER_KERNEL = 1.5
Run = Callable[[], None]


def _leaf(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, scale: float = 1.0):
    gen = torch.Generator().manual_seed(len(shape) * 7919 + shape[-1])
    return (torch.randn(shape, generator=gen) * scale).to(device, dtype).requires_grad_()


def _backward_of(forward: Callable[[], torch.Tensor]) -> Run:
    """Forward and backward of ``forward()``'s output against a fixed random gradient."""
    grads: list[torch.Tensor] = []

    def run() -> None:
        out = forward()
        if not out.requires_grad:  # a kernel without a backward here (FlexAttention on CPU)
            return
        if not grads:
            grads.append(torch.randn_like(out))
        out.backward(grads[0])

    return run


def mm_rate(device: torch.device, edge: int, repeats: int) -> dict[str, float]:
    """``torch.mm``'s achieved BF16 FLOP/s on an [edge, edge] x [edge, edge] product."""
    a = torch.randn(edge, edge, device=device, dtype=torch.bfloat16)
    b = torch.randn(edge, edge, device=device, dtype=torch.bfloat16)
    seconds = median_seconds(lambda: torch.mm(a, b), device, repeats, warmup=3)
    return {"edge": edge, "seconds": seconds, "flops_per_s": 2 * edge**3 / seconds}


def ssd_alone(
    model: Any, shape: tuple[int, int], documents: torch.Tensor, device: torch.device
) -> Run:
    """The SSD scan alone on the Mamba layer's tensors (x and B, C in BF16, dt, A, D in fp32)."""
    from factory.kernels.ssd import ScanInputs, ssd_chunked_scan

    m, (b, s) = model.mamba, shape
    x = _leaf((b, s, m.heads, m.head_dim), torch.bfloat16, device)
    dt = (torch.rand(b, s, m.heads, device=device) * 0.1 + 1e-3).requires_grad_()
    A = (-torch.rand(m.heads, device=device) * 8 - 1).requires_grad_()
    B = _leaf((b, s, m.groups, m.state_size), torch.bfloat16, device)
    C = _leaf((b, s, m.groups, m.state_size), torch.bfloat16, device)
    D = torch.ones(m.heads, device=device, requires_grad=True)
    return _backward_of(lambda: ssd_chunked_scan(
        ScanInputs(x, dt, A, B, C, D=D, seq_idx=documents), m.chunk_size))  # fmt: skip


def _qkv(model: Any, shape: tuple[int, int], device: torch.device) -> list[torch.Tensor]:
    a, (b, s) = model.attention, shape
    q = _leaf((b, a.heads, s, a.head_dim), torch.bfloat16, device)
    return [q] + [_leaf((b, a.kv_heads, s, a.head_dim), torch.bfloat16, device) for _ in "kv"]


def attention_alone(
    model: Any, shape: tuple[int, int], documents: torch.Tensor, device: torch.device
) -> Run:
    """The attention layer's dispatch alone (``causal_attention``) with the documents."""
    from factory.layers.attention.module import causal_attention

    q, k, v = _qkv(model, shape, device)
    return _backward_of(lambda: causal_attention(q, k, v, documents))


def flex_alone(
    model: Any, shape: tuple[int, int], documents: torch.Tensor, device: torch.device
) -> Run:
    """FlexAttention with a causal document block mask: compiled on CUDA; on CPU (a dry run)
    eager and forward only, as FlexAttention has no CPU backward."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    q, k, v = _qkv(model, shape, device)
    if device.type != "cuda":
        for t in (q, k, v):
            t.requires_grad_(False)

    def same_document(b: Any, h: Any, q_index: Any, kv_index: Any) -> Any:
        return (q_index >= kv_index) & (documents[b, q_index] == documents[b, kv_index])

    mask = create_block_mask(same_document, shape[0], None, shape[1], shape[1], device=device)
    flex = torch.compile(flex_attention) if device.type == "cuda" else flex_attention
    return _backward_of(lambda: flex(q, k, v, block_mask=mask, enable_gqa=True))


def grouped_gemms_alone(model: Any, shape: tuple[int, int], device: torch.device) -> Run:
    """The routed experts' grouped GEMMs on the layer's pairs, sorted by expert, balanced."""
    from factory.kernels.moe_dispatch import ExpertWeights, grouped_mm_sorted, route_tokens

    moe, tokens = model.moe, shape[0] * shape[1]
    gen = torch.Generator().manual_seed(0)
    index = torch.rand(tokens, moe.num_experts, generator=gen).topk(moe.top_k).indices
    dispatch = route_tokens(index.to(device), moe.num_experts)
    xs = _leaf((tokens * moe.top_k, model.hidden_size), torch.bfloat16, device)
    width = moe.expert_intermediate_size
    up = _leaf((moe.num_experts, width, model.hidden_size), torch.bfloat16, device, 0.02)
    down = _leaf((moe.num_experts, model.hidden_size, width), torch.bfloat16, device, 0.02)
    return _backward_of(lambda: grouped_mm_sorted(xs, dispatch, ExpertWeights(up, down)))


KERNELS: dict[str, dict[str, Callable[..., Run]]] = {
    "M": {"ssd_chunked_scan": ssd_alone},
    "*": {"causal_attention": attention_alone, "FlexAttention, block mask": flex_alone},
    "E": {"grouped GEMMs (routed experts)": lambda m, s, d, dev: grouped_gemms_alone(m, s, dev)},
}
"""Per layer symbol: its kernels alone, each ``(model config, (batch, seq), documents,
device) -> forward + backward``."""


def layer_flops(model: Any, symbol: str, tokens: int, seq: int) -> float:
    """Training FLOPs of one ``symbol`` block on ``tokens`` tokens (the plan's exact count)."""
    from factory.planner.flops import flops_per_token
    from factory.spec.layer_type import layer_type

    per_type = flops_per_token(model, seq).by_layer_type[layer_type(symbol).name]
    return per_type / model.parsed_pattern.main.count(symbol) * tokens


def run(ctx: SectionContext) -> None:
    import factory
    from factory.graph.block_compile import compile_blocks
    from factory.graph.blocks import Block
    from factory.spec.layer_type import layer_type

    blueprint = load(ctx.dry_run, (f"model.pattern={PATTERN}",))
    _, batch, seq = step_shape(load(ctx.dry_run), ctx.dry_run)
    cfg, tokens, device = blueprint.model, batch * seq, ctx.device
    repeats = 2 if ctx.dry_run else 10
    ctx.record("shape", {"batch": batch, "seq_len": seq, "documents_per_sequence": DOCUMENTS,
                         "hidden": cfg.hidden_size})  # fmt: skip
    edge = DRY_MM_EDGE if ctx.dry_run else MM_EDGE
    mm = mm_rate(device, edge, repeats)
    ctx.record("mm", mm)
    model = factory.compile(blueprint, device=device, seed=0, dtype=torch.bfloat16,
                            precision="off").model.train()  # fmt: skip
    blocks = {m.symbol: m for m in model.modules() if isinstance(m, Block)}
    documents = packed_documents(batch, seq, device)
    hidden = _leaf((batch, seq, cfg.hidden_size), torch.bfloat16, device)
    layers: dict[str, dict[str, Any]] = {}

    def save() -> None:
        ctx.record("layers", layers)

    for symbol, block in blocks.items():
        flops = layer_flops(cfg, symbol, tokens, seq)
        layers[symbol] = {"layer_type": layer_type(symbol).name, "flops": flops,
                          "floor_s": flops / mm["flops_per_s"], "kernels": {}}  # fmt: skip
        step = _backward_of(lambda b=block: b(hidden, documents)[0])
        layers[symbol]["block_eager_s"] = attempt(
            ctx, f"{symbol} block", lambda s=step: median_seconds(s, device, repeats)
        )
        save()
        for name, build in KERNELS.get(symbol, {}).items():
            seconds = attempt(ctx, f"{symbol} {name}", lambda b=build: median_seconds(
                b(cfg, (batch, seq), documents, device), device, repeats, warmup=2))  # fmt: skip
            layers[symbol]["kernels"][name] = seconds
            save()
    compiled = compile_blocks(model, backend="aot_eager" if ctx.dry_run else "inductor")
    for symbol, block in blocks.items():
        if not any(path == block.path for path in compiled):
            layers[symbol]["block_compiled_s"] = None  # the layer type has no static shapes
            continue
        step = _backward_of(lambda b=block: b(hidden, documents)[0])
        layers[symbol]["block_compiled_s"] = attempt(
            ctx, f"{symbol} compiled block",
            lambda s=step: median_seconds(s, device, repeats, warmup=2))  # fmt: skip
        save()
    ctx.record("goal_over_kernel", GOAL_OVER_KERNEL)


def _best_block(layer: dict[str, Any]) -> float | None:
    times = [t for t in (layer.get("block_compiled_s"), layer.get("block_eager_s")) if t]
    return min(times) if times else None


def markdown(results: dict[str, Any]) -> str:
    mm, shape = results.get("mm", {}), results.get("shape", {})
    text = (f"One block forward + backward at {shape.get('batch')} x {shape.get('seq_len')} "
            f"tokens ({shape.get('documents_per_sequence')} documents), BF16. torch.mm BF16 at "
            f"{mm.get('edge')}^3: {mm.get('flops_per_s', 0) / 1e12:.4g} TFLOP/s (the floor's "
            "rate). Ratios: the block's faster mode over each.\n\n")  # fmt: skip
    rows = []
    for symbol, layer in results.get("layers", {}).items():
        block = _best_block(layer)
        rows.append([f"{symbol} block", "eager", layer.get("block_eager_s"), None, None])
        rows.append([f"{symbol} block", "compiled", layer.get("block_compiled_s"), None, None])
        for name, seconds in layer.get("kernels", {}).items():
            ratio = block / seconds if block and seconds else None
            rows.append([f"{symbol} kernel", name, seconds, ratio, None])
        floor = layer["floor_s"]
        rows.append([f"{symbol} GEMM floor", f"{layer['flops'] / 1e9:,.4g} GFLOP", floor, None,
                     block / floor if block else None])  # fmt: skip
    text += table(["layer", "what", "seconds", "block / kernel", "block / floor"], rows)
    goal = results.get("goal_over_kernel")
    return text + (f"\nGoal: each block within {goal}x of its kernel.\n" if goal else "")
