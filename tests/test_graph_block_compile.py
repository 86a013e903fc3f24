"""``compile_blocks``: which blocks get compiled comes from the layer types (the MoE block
where its dispatch is sync-free), and a compiled model computes what the eager one does (loss
and every gradient, with packed documents)."""

from __future__ import annotations

import copy

import torch
from blueprint_factory import make
from runtime_helpers import MICRO, SEQ, tiny_blueprint
from torch._dynamo.utils import counters

import factory
from factory.graph.block_compile import compile_blocks
from factory.graph.blocks import Block
from factory.nn.packed_documents import document_ids_from_cu_seqlens
from factory.spec.layer_type import layer_type

PATTERN = "M*ME-M*ME"


def _model(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    bp = make(**{"model.pattern": PATTERN, "model.mamba.chunk_size": 8})
    return factory.compile(bp, seed=0, precision="off", dtype=dtype).model


def test_routed_blocks_compile_where_their_dispatch_is_sync_free() -> None:
    """The sync-free ``_grouped_mm`` path (fp32 and BF16, aligned widths): every block
    compiles. A quantized expert GEMM hook takes padded batches, sized on the host: then the
    MoE blocks stay eager and every other block compiles."""
    assert [s for s in PATTERN if not layer_type(s).static_shapes] == ["E", "E"]
    for dtype in (torch.float32, torch.bfloat16):
        model = _model(dtype)
        routed = [b for b in model.backbone.layers if b.symbol == "E"]
        assert routed and all(layer_type("E").compiles(b) for b in routed)
        assert compile_blocks(model) == [f"backbone.layers.{i}" for i in range(len(PATTERN))]
    hooked = _model()
    for block in hooked.backbone.layers:
        if block.symbol == "E":
            block.mixer.experts.linear = lambda name, x, w: torch.bmm(x, w.transpose(1, 2))
    compiled = compile_blocks(hooked)
    assert compiled == [f"backbone.layers.{i}" for i, s in enumerate(PATTERN) if s != "E"]
    for i, block in enumerate(hooked.backbone.layers):  # compiled means wrapped for dynamo
        assert (block._compiled_call_impl is not None) == (f"backbone.layers.{i}" in compiled)


def test_compiled_blocks_give_the_eager_loss_and_gradients() -> None:
    # The runtime tests' tiny Super proxy at their micro-batch shape: the training-loop test
    # then finds these graphs in inductor's cache instead of compiling them again.
    eager = factory.compile(tiny_blueprint(), seed=0, precision="off").model.train()
    compiled = copy.deepcopy(eager)
    compile_blocks(compiled)
    torch._dynamo.reset()
    counters.clear()
    generator = torch.Generator().manual_seed(0)
    vocab = eager.lm_head.weight.shape[0]
    ids = torch.randint(0, vocab, (MICRO, SEQ), generator=generator)
    docs = document_ids_from_cu_seqlens([[0, 10, SEQ], [0, SEQ]], SEQ)
    losses = []
    for model in (eager, compiled):
        logits = model(ids, docs).logits
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        losses.append(loss.item())
    # Traced, not skipped, and blocks of one kind share one graph, with no break: the main
    # stack's M, * and E blocks, and the MTP blocks' * and E (Blocks of their own class),
    # make five.
    blocks = [b for b in compiled.modules() if isinstance(b, Block)]
    static = {(type(b), b.symbol) for b in blocks if layer_type(b.symbol).compiles(b)}
    assert counters["stats"]["unique_graphs"] == len(static) == 5
    assert abs(losses[0] - losses[1]) <= 1e-5 * abs(losses[0])
    pairs = list(zip(eager.named_parameters(), compiled.parameters(), strict=True))
    for (name, a), b in pairs:  # the same parameters get gradients (not MTP's: logits only)
        assert (a.grad is None) == (b.grad is None), name
    trained = [(name, a, b) for (name, a), b in pairs if a.grad is not None]
    assert len(trained) > 30
    for name, a, b in trained:
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-6, msg=name)
