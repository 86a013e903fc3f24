"""The fused, chunked LM head and cross-entropy: equal to the unfused loss (values and the
gradients of the head's input and weight), over shapes, chunks, target weights, ignored
targets, MTP depths and context-parallel rows; the whole training step equal to the unfused
one; no [tokens, vocab] tensor anywhere in the fused step; the kernel report's answer."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from runtime_helpers import tiny_blueprint
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn import functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import factory
from factory.graph.loss import fused_head_problem, language_model_loss, loss_kernel
from factory.kernels import linear_cross_entropy as linear_cross_entropy_module
from factory.kernels.linear_cross_entropy import (
    DEFAULT_LOGITS_CHUNK_BYTES,
    chunk_tokens_for,
    linear_cross_entropy,
)
from factory.nn.outputs import ModelOutput
from factory.precision.policy import excluded_gemm_names
from factory.runtime.batches import MicroBatch
from factory.runtime.step import forward_backward

# fp32: the chunks' GEMMs and the fp32 sum of the weight gradient's chunk terms differ from
# one GEMM by rounding only. bf16: the weight gradient's chunk terms are each rounded to
# bf16 before their fp32 sum (the unfused GEMM rounds once): a few bf16 ulps of its scale.
TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2)}


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    rtol, atol = TOLERANCE[dtype]
    scale = max(1.0, float(want.detach().abs().max())) if want.numel() else 1.0
    torch.testing.assert_close(got.float(), want.float(), rtol=rtol, atol=atol * scale)


@settings(max_examples=40, deadline=None)
@given(
    tokens=st.integers(0, 40),
    hidden=st.integers(1, 24),
    vocab=st.integers(2, 70),
    chunk=st.integers(1, 48),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    seed=st.integers(0, 2**16),
)
def test_kernel_equals_head_then_cross_entropy(
    tokens: int, hidden: int, vocab: int, chunk: int, dtype: torch.dtype, seed: int
) -> None:
    """Per-token losses and both gradients, for any upstream gradient (zeros included, as
    ignored targets give), with chunks that need not divide the tokens."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype).requires_grad_()
    weight = torch.randn(vocab, hidden, generator=gen).to(dtype).requires_grad_()
    labels = torch.randint(0, vocab, (tokens,), generator=gen)
    upstream = torch.rand(tokens, generator=gen) * (torch.rand(tokens, generator=gen) > 0.3)

    fused = linear_cross_entropy(x, weight, labels, chunk)
    fused_grads = torch.autograd.grad((fused * upstream).sum(), (x, weight))
    unfused = F.cross_entropy((x @ weight.T).float(), labels, reduction="none")
    unfused_grads = torch.autograd.grad((unfused * upstream).sum(), (x, weight))

    assert fused.dtype == torch.float32
    # The forward computes each row exactly as the unfused loss does.
    _close(fused, unfused, torch.float32)
    for got, want in zip(fused_grads, unfused_grads, strict=True):
        assert got.dtype == dtype
        _close(got, want, dtype)


def test_kernel_rejects_a_chunk_below_one_row() -> None:
    with pytest.raises(ValueError, match="chunk_tokens"):
        linear_cross_entropy(torch.zeros(2, 3), torch.zeros(4, 3), torch.zeros(2).long(), 0)


def test_default_chunk_is_a_quarter_gibibyte_of_fp32_logits() -> None:
    assert DEFAULT_LOGITS_CHUNK_BYTES == 256 * 2**20
    assert chunk_tokens_for(131072) == 512
    assert chunk_tokens_for(2**40) == 1


def _head_output(
    inputs: list[torch.Tensor], weight: torch.Tensor, fused: bool, positions: torch.Tensor | None
) -> ModelOutput:
    """What a model returns for the fused loss (its head's inputs), or its logits."""
    if fused:
        return ModelOutput(None, (), None, {}, inputs[0], {}, positions, tuple(inputs), weight)
    logits = [x @ weight.T for x in inputs]
    return ModelOutput(logits[0], tuple(logits[1:]), None, {}, inputs[0], {}, positions)


@settings(max_examples=40, deadline=None)
@given(
    data=st.data(),
    average=st.sampled_from(["token", "conversation"]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_language_model_loss_fused_equals_unfused(
    data: st.DataObject, average: str, dtype: torch.dtype
) -> None:
    """Every loss of the breakdown and the gradients of every head input and the head weight:
    loss masks (ignored targets), packed documents, both averages, MTP depths, a context-
    parallel rank's rows, chunks that do not divide the rows."""
    rows, seq = data.draw(st.integers(1, 3)), data.draw(st.integers(2, 12))
    hidden, vocab = data.draw(st.integers(1, 12)), data.draw(st.integers(2, 40))
    depths = data.draw(st.integers(0, 2))
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    ids = torch.randint(0, vocab, (rows, seq), generator=gen)
    mask = torch.rand(rows, seq, generator=gen) > data.draw(st.sampled_from([0.0, 0.4, 1.0]))
    docs = None
    if data.draw(st.booleans()):
        docs = (torch.rand(rows, seq, generator=gen) > 0.7).long().cumsum(1)
    positions = None
    if data.draw(st.booleans()):  # this rank's positions of the sequence, in any order
        kept = data.draw(st.lists(st.integers(0, seq - 1), min_size=1, max_size=seq, unique=True))
        positions = torch.tensor(kept)
    here = seq if positions is None else len(positions)
    inputs = [
        torch.randn(rows, here, hidden, generator=gen).to(dtype).requires_grad_()
        for _ in range(1 + depths)
    ]
    weight = torch.randn(vocab, hidden, generator=gen).to(dtype).requires_grad_()
    chunk = data.draw(st.integers(1, rows * seq + 3))
    results = []
    for fused in (True, False):
        losses = language_model_loss(
            _head_output(inputs, weight, fused, positions),
            ids,
            mask,
            mtp_loss_scale=0.3,
            document_ids=docs,
            loss_average=average,
            chunk_tokens=chunk,
        )
        grads = torch.autograd.grad(losses.total, [*inputs, weight], allow_unused=True)
        results.append((losses, grads))
    (fused_losses, fused_grads), (losses, grads) = results
    _close(fused_losses.total.detach(), losses.total.detach(), torch.float32)
    _close(fused_losses.lm.detach(), losses.lm.detach(), torch.float32)
    assert len(fused_losses.mtp) == len(losses.mtp)
    for got, want in zip(fused_losses.mtp, losses.mtp, strict=True):
        _close(got.detach(), want.detach(), torch.float32)
    for got, want in zip(fused_grads, grads, strict=True):
        assert (got is None) == (want is None)
        if got is not None:
            _close(got, want, dtype)


class _Unfused(nn.Module):
    """Today's step: the model's logits whatever the step asks for."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor, docs: torch.Tensor | None, logits: bool = True) -> Any:
        return self.model(ids, docs)


@pytest.fixture(scope="module")
def tiny() -> factory.Compiled:
    """The tiny Super proxy (Mamba, attention, LatentMoE, two MTP depths) in fp32. Precision
    off: its NVFP4 gradients round stochastically, so no two steps agree, fused or not."""
    return factory.compile(tiny_blueprint(), seed=3, precision="off")


def _micro(vocab: int, seed: int) -> list[MicroBatch]:
    gen = torch.Generator().manual_seed(seed)
    micro = []
    for _ in range(2):
        ids = torch.randint(0, vocab, (2, 24), generator=gen)
        mask = torch.rand(2, 24, generator=gen) > 0.3
        docs = (torch.rand(2, 24, generator=gen) > 0.8).long().cumsum(1)
        micro.append(MicroBatch(ids, mask, docs))
    return micro


def _step(model: nn.Module, micro: list[MicroBatch], average: str) -> tuple[Any, dict]:
    model.zero_grad()
    outcome = forward_backward(model, micro, 0.3, loss_average=average)
    named = model.model if isinstance(model, _Unfused) else model
    return outcome, {n: p.grad.clone() for n, p in named.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("average", ["token", "conversation"])
def test_training_step_equals_the_unfused_step(tiny: factory.Compiled, average: str) -> None:
    model = tiny.model.train()
    micro = _micro(tiny.blueprint.model.vocab_size, seed=5)
    fused, fused_grads = _step(model, micro, average)
    unfused, grads = _step(_Unfused(model), micro, average)
    assert fused.loss == pytest.approx(unfused.loss, rel=1e-6)
    assert fused.lm_loss == pytest.approx(unfused.lm_loss, rel=1e-6)
    assert fused.tokens == unfused.tokens
    assert fused_grads.keys() == grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(fused_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_training_step_is_bitwise_reproducible(tiny: factory.Compiled) -> None:
    model = tiny.model.train()
    micro = _micro(tiny.blueprint.model.vocab_size, seed=6)
    first, first_grads = _step(model, micro, "token")
    second, second_grads = _step(model, micro, "token")
    assert first.loss == second.loss
    assert all(torch.equal(first_grads[n], g) for n, g in second_grads.items())


def test_the_model_leaves_its_head_to_the_loss_only_when_asked(tiny: factory.Compiled) -> None:
    model = tiny.model.eval()
    ids = torch.randint(0, tiny.blueprint.model.vocab_size, (2, 16))
    with torch.no_grad():
        plain, fused = model(ids), model(ids, logits=False)
    assert plain.logits is not None and len(plain.mtp_logits) == tiny.blueprint.model.mtp_depth
    assert plain.head_inputs == () and plain.head_weight is None
    assert fused.logits is None and fused.mtp_logits == ()
    assert len(fused.head_inputs) == 1 + tiny.blueprint.model.mtp_depth
    assert fused.head_weight is model.lm_head.weight
    heads = (plain.logits, *plain.mtp_logits)
    for logits, head_input in zip(heads, fused.head_inputs, strict=True):
        torch.testing.assert_close(model.lm_head(head_input), logits)
    assert fused.rows == plain.rows == ids.shape


class _WidestVocabRows(TorchDispatchMode):
    """Records, over every op the dispatcher runs, the most rows of any tensor it allocates
    (views allocate nothing: the head weight's transpose is one) whose last dimension is the
    vocabulary (logits, their probabilities or gradients)."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.vocab = vocab
        self.rows = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func.is_view:
            return out
        for tensor in out if isinstance(out, tuple | list) else (out,):
            if isinstance(tensor, torch.Tensor) and tensor.dim() and tensor.shape[-1] == self.vocab:
                self.rows = max(self.rows, tensor.numel() // self.vocab)
        return out


@contextmanager
def _watching(vocab: int) -> Iterator[_WidestVocabRows]:
    with _WidestVocabRows(vocab) as mode:
        yield mode


@pytest.mark.parametrize("fused", [True, False])
def test_fused_step_never_holds_the_logits_of_all_tokens(
    tiny: factory.Compiled, fused: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Forward and backward of the step (CPU autograd runs on this thread, under the mode):
    the fused loss's widest vocab-wide tensor is one chunk; the unfused one, every token's
    logits (the check fails for it, so it can fail)."""
    model = tiny.model.train()
    vocab = tiny.blueprint.model.vocab_size
    micro = _micro(vocab, seed=7)
    tokens = micro[0].input_ids.numel()
    chunk = 16  # rows: 46 for the main head, 44 and 42 for the MTP depths; none divides
    monkeypatch.setattr(
        linear_cross_entropy_module, "DEFAULT_LOGITS_CHUNK_BYTES", chunk * 4 * vocab
    )
    assert chunk_tokens_for(vocab) == chunk
    with _watching(vocab) as watch:
        forward_backward(model if fused else _Unfused(model), micro, 0.3)
    if fused:
        assert 0 < watch.rows <= chunk
    else:
        assert watch.rows >= tokens


def test_kernel_choice() -> None:
    model = factory.load_blueprint("nano").model
    for device in ("cpu", "cuda"):
        choice = loss_kernel(model, device)
        assert choice.fallback is None
        assert f"fused chunked linear + cross-entropy ({chunk_tokens_for(model.vocab_size)}" in (
            choice.kernel
        )
    split = loss_kernel(model, "cuda", tensor_parallel=2)
    assert split.kernel.startswith("unfused") and "vocab-parallel" in (split.fallback or "")
    staged = loss_kernel(model, "cuda", pipeline_parallel=2)
    assert staged.kernel.startswith("unfused") and "pipeline" in (staged.fallback or "")


def test_a_vocab_split_head_keeps_its_logits() -> None:
    """The model's dispatch asks the report's test: a DTensor head (tensor parallelism)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    assert fused_head_problem(torch.zeros(8, 4)) is None
    with _one_gloo_process() as mesh:
        weight = distribute_tensor(torch.zeros(8, 4), mesh, [Shard(0)])
        split = loss_kernel(factory.load_blueprint("nano").model, "cuda", tensor_parallel=2)
        assert fused_head_problem(weight) == split.fallback


@contextmanager
def _one_gloo_process() -> Iterator[DeviceMesh]:
    store = torch.distributed.HashStore()
    torch.distributed.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield DeviceMesh("cpu", [0])
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.parametrize("shard", [True, False], ids=["fully_shard", "replicate"])
def test_fsdp2_wrapped_model_fuses_and_steps_as_unwrapped(
    tiny: factory.Compiled, shard: bool
) -> None:
    """FSDP2 does not reshard its root after the forward, so the head weight the output
    carries is the gathered one the loss may use; its gradient reaches the parameter."""
    from factory.distributed.data_parallel import apply_data_parallel

    micro = _micro(tiny.blueprint.model.vocab_size, seed=8)
    plain, plain_grads = _step(tiny.model.train(), micro, "token")
    with _one_gloo_process() as mesh:
        model = copy.deepcopy(tiny.model)
        apply_data_parallel(model, mesh, mesh, shard=shard)
        with torch.no_grad():
            assert model(micro[0].input_ids, logits=False).logits is None
        wrapped, wrapped_grads = _step(model, micro, "token")
        full = {n: getattr(g, "full_tensor", lambda g=g: g)() for n, g in wrapped_grads.items()}
    assert wrapped.loss == plain.loss
    assert full.keys() == plain_grads.keys()
    assert all(torch.equal(full[n], g) for n, g in plain_grads.items())


@pytest.mark.parametrize("name", ["nano", "super", "ultra"])
def test_the_precision_policy_never_quantizes_the_head(name: str) -> None:
    """The fused loss multiplies by the head weight itself: right only while no precision
    recipe quantizes the head's GEMM."""
    assert "lm_head" in excluded_gemm_names(factory.load_blueprint(name).model)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_fused_equals_unfused_and_holds_one_chunk() -> None:
    """BF16 on the device (cuBLAS GEMMs per chunk), and the peak memory the fused loss's
    forward and backward add: under one [tokens, vocab] fp32 tensor, which the unfused one
    allocates (several times)."""
    tokens, width, vocab, chunk = 4096, 512, 32768, 256
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(tokens, width, generator=gen) / width**0.5).cuda().bfloat16()
    weight = (torch.randn(vocab, width, generator=gen) * 0.02).cuda().bfloat16()
    labels = torch.randint(0, vocab, (tokens,), generator=gen).cuda()
    results = {}
    for name in ("fused", "unfused"):
        h, w = x.clone().requires_grad_(), weight.clone().requires_grad_()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        if name == "fused":
            losses = linear_cross_entropy(h, w, labels, chunk)
        else:
            losses = F.cross_entropy((h @ w.T).float(), labels, reduction="none")
        grads = torch.autograd.grad(losses.mean(), (h, w))
        torch.cuda.synchronize()
        results[name] = (losses.detach(), *grads, torch.cuda.max_memory_allocated() - base)
    *fused, fused_peak = results["fused"]
    *unfused, unfused_peak = results["unfused"]
    _close(fused[0], unfused[0], torch.float32)
    for got, want in zip(fused[1:], unfused[1:], strict=True):
        _close(got, want, torch.bfloat16)
    all_logits = tokens * vocab * 4
    assert fused_peak < all_logits <= unfused_peak
