"""Mamba-2 SSD scan: chunked form vs the sequential recurrence and vs transformers."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from factory.kernels.ssd import (
    ScanInputs,
    _IntraChunk,
    fast_path_available,
    ssd_chunked_scan,
    ssd_chunked_scan_torch,
    ssd_sequential_scan,
)


def make_inputs(
    seed: int,
    b: int,
    length: int,
    h: int,
    g: int,
    p: int,
    n: int,
    *,
    with_d: bool = True,
    with_init: bool = True,
    dtype: torch.dtype = torch.float64,
) -> dict[str, torch.Tensor | None]:
    """Random SSD inputs with realistic ranges: dt in (0.01, 0.5], A in [-3.2, -0.2)."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)

    def rand(*shape: int) -> torch.Tensor:
        return torch.rand(*shape, generator=gen, dtype=torch.float64).to(dtype)

    return {
        "x": randn(b, length, h, p),
        "dt": rand(b, length, h) * 0.49 + 0.01,
        "A": -(rand(h) * 3 + 0.2),
        "B": randn(b, length, g, n),
        "C": randn(b, length, g, n),
        "D": randn(h) if with_d else None,
        "initial_state": randn(b, h, p, n) if with_init else None,
    }


def run(
    fn,
    inputs: dict[str, torch.Tensor | None],
    chunk_size: int | None = None,
    final: bool = True,
    seq_idx: torch.Tensor | None = None,
):
    """``fn`` on ``inputs``; the sequential reference takes no ``chunk_size``."""
    chunking = () if chunk_size is None else (chunk_size,)
    return fn(ScanInputs(**inputs, seq_idx=seq_idx), *chunking, return_final_state=final)


@st.composite
def ssd_cases(draw: st.DrawFn) -> tuple[dict[str, torch.Tensor | None], int]:
    h = draw(st.integers(1, 4))
    g = draw(st.sampled_from([d for d in range(1, h + 1) if h % d == 0]))
    inputs = make_inputs(
        draw(st.integers(0, 2**16)),
        b=draw(st.integers(1, 2)),
        length=draw(st.integers(1, 70)),
        h=h,
        g=g,
        p=draw(st.integers(1, 8)),
        n=draw(st.integers(1, 8)),
        with_d=draw(st.booleans()),
        with_init=draw(st.booleans()),
    )
    return inputs, draw(st.integers(1, 32))


@settings(deadline=None, max_examples=60, derandomize=True)
@given(ssd_cases())
def test_chunked_matches_sequential(case: tuple[dict[str, torch.Tensor | None], int]) -> None:
    inputs, chunk_size = case
    y, state = run(ssd_chunked_scan, inputs, chunk_size)
    y_ref, state_ref = run(ssd_sequential_scan, inputs)
    assert y.shape == inputs["x"].shape and y.dtype == torch.float64
    torch.testing.assert_close(y, y_ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(state, state_ref, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("chunk_size", [1, 3, 16, 64])
def test_chunk_size_invariance_fp32(chunk_size: int) -> None:
    """fp32 inputs: every chunking agrees with the fp64 recurrence to fp32 accuracy."""
    inputs = make_inputs(1, 2, 45, 4, 2, 8, 8, dtype=torch.float32)
    y, state = run(ssd_chunked_scan, inputs, chunk_size)
    as64 = {k: None if v is None else v.double() for k, v in inputs.items()}
    y_ref, state_ref = run(ssd_sequential_scan, as64)
    assert y.dtype == torch.float32 and state.dtype == torch.float32
    torch.testing.assert_close(y.double(), y_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state.double(), state_ref, rtol=1e-5, atol=1e-5)


def test_without_final_state_returns_tensor() -> None:
    inputs = make_inputs(2, 1, 5, 2, 1, 2, 3)
    y = run(ssd_chunked_scan, inputs, 4, final=False)
    assert isinstance(y, torch.Tensor)
    torch.testing.assert_close(y, run(ssd_sequential_scan, inputs, final=False))


def test_bf16_input_keeps_dtype_and_fp32_state() -> None:
    inputs = make_inputs(3, 1, 20, 2, 1, 4, 4, dtype=torch.bfloat16)
    inputs["A"] = inputs["A"].float()
    y, state = run(ssd_chunked_scan, inputs, 8)
    assert y.dtype == torch.bfloat16 and state.dtype == torch.float32
    as32 = {k: None if v is None else v.float() for k, v in inputs.items()}
    y_ref, state_ref = run(ssd_sequential_scan, as32)
    torch.testing.assert_close(state, state_ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(y.float(), y_ref, rtol=2e-2, atol=2e-2)


def test_state_carries_across_calls() -> None:
    """Scanning in two halves through the final/initial state equals one scan."""
    inputs = make_inputs(4, 2, 30, 4, 2, 3, 5)
    y_full, state_full = run(ssd_chunked_scan, inputs, 8)
    per_step = {"x", "dt", "B", "C"}
    first = {k: (v[:, :13] if k in per_step else v) for k, v in inputs.items()}
    y1, s1 = run(ssd_chunked_scan, first, 8)
    second = {k: (v[:, 13:] if k in per_step else v) for k, v in inputs.items()}
    second["initial_state"] = s1
    y2, s2 = run(ssd_chunked_scan, second, 8)
    torch.testing.assert_close(torch.cat([y1, y2], dim=1), y_full)
    torch.testing.assert_close(s2, state_full)


def test_gradcheck_float64() -> None:
    inputs = make_inputs(5, 1, 5, 2, 1, 2, 3)
    names = ["x", "dt", "A", "B", "C", "D", "initial_state"]
    leaves = [inputs[k].clone().requires_grad_() for k in names]

    def fn(*args: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return ssd_chunked_scan(ScanInputs(*args), 2, return_final_state=True)

    assert torch.autograd.gradcheck(fn, leaves, eps=1e-6, atol=1e-6)


def test_gradients_match_sequential() -> None:
    inputs = make_inputs(6, 2, 23, 4, 2, 3, 4)
    names = ["x", "dt", "A", "B", "C", "D", "initial_state"]
    grads = []
    for fn, chunk_size in ((ssd_chunked_scan, 8), (ssd_sequential_scan, None)):
        leaves = {k: inputs[k].clone().requires_grad_() for k in names}
        y, state = run(fn, leaves, chunk_size)
        (y.sin().sum() + state.cos().sum()).backward()
        grads.append([leaves[k].grad for k in names])
    for name, g_chunk, g_seq in zip(names, *grads, strict=True):
        torch.testing.assert_close(g_chunk, g_seq, rtol=1e-9, atol=1e-9, msg=name)


def test_matches_transformers_mamba2_chunk_scan() -> None:
    """transformers' pure-PyTorch NemotronH scan is an independent implementation."""
    modeling = pytest.importorskip("transformers.models.nemotron_h.modeling_nemotron_h")
    inputs = make_inputs(7, 2, 50, 4, 2, 8, 8, dtype=torch.float32)
    y, state = run(ssd_chunked_scan, inputs, 16)
    y_hf, state_hf = modeling.mamba2_chunk_scan(
        inputs["x"],
        inputs["dt"],
        inputs["A"],
        inputs["B"],
        inputs["C"],
        16,
        D=inputs["D"],
        initial_states=inputs["initial_state"],
        dt_softplus=False,
        dt_limit=(0.0, math.inf),
        return_final_states=True,
    )
    torch.testing.assert_close(y, y_hf, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(state, state_hf, rtol=1e-4, atol=1e-4)


def test_long_chunk_decay_is_stable() -> None:
    """Strong decay over a long chunk: no NaN/inf, agrees with the recurrence."""
    inputs = make_inputs(8, 1, 256, 2, 1, 4, 4, dtype=torch.float32)
    inputs["dt"] = inputs["dt"] * 0 + 0.5
    inputs["A"] = torch.tensor([-16.0, -1.0])
    y, state = run(ssd_chunked_scan, inputs, 256)
    y_ref, state_ref = run(ssd_sequential_scan, inputs)
    assert torch.isfinite(y).all()
    torch.testing.assert_close(y, y_ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(state, state_ref, rtol=1e-4, atol=1e-4)


def test_per_channel_d() -> None:
    inputs = make_inputs(9, 1, 9, 2, 2, 3, 2)
    inputs["D"] = torch.randn(2, 3, dtype=torch.float64)
    torch.testing.assert_close(
        run(ssd_chunked_scan, inputs, 4)[0], run(ssd_sequential_scan, inputs)[0]
    )


def test_shape_errors() -> None:
    inputs = make_inputs(10, 1, 4, 3, 1, 2, 2)
    inputs["B"] = torch.randn(1, 4, 2, 2, dtype=torch.float64)
    inputs["C"] = inputs["B"]
    with pytest.raises(ValueError, match="multiple of groups"):
        run(ssd_chunked_scan, inputs, 2)
    with pytest.raises(ValueError, match="chunk_size"):
        run(ssd_chunked_scan_torch, make_inputs(10, 1, 4, 2, 1, 2, 2), 0)


def test_no_fast_path_on_cpu() -> None:
    assert not fast_path_available("cpu")
    assert not fast_path_available(torch.device("cpu"))


def test_fast_path_dispatch_plumbing(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the Triton kernel "available", arguments reach it under mamba_ssm's names."""
    from factory.kernels import ssd

    calls = []

    def fake_kernel(x, dt, A, B, C, chunk_size, *, D, initial_states, return_final_states, seq_idx):
        calls.append(chunk_size)
        assert seq_idx is None or seq_idx.dtype == torch.int32  # mamba_ssm's dtype
        scan = ScanInputs(x, dt, A, B, C, D, initial_states, seq_idx)
        y, state = ssd_sequential_scan(scan, return_final_state=True)
        return (y, state.to(torch.bfloat16)) if return_final_states else y

    monkeypatch.setattr(ssd, "_choose", lambda device, dtype, chunk_size: (fake_kernel, None))
    inputs = make_inputs(11, 1, 7, 2, 1, 2, 3, dtype=torch.float32)
    _, state = run(ssd_chunked_scan, inputs, 64)
    assert calls == [64] and state.dtype == torch.float32
    assert isinstance(run(ssd_chunked_scan, inputs, 64, final=False), torch.Tensor)
    seq_idx = torch.tensor([[0, 0, 0, 1, 1, 1, 1]])
    y = run(ssd_chunked_scan, inputs, 64, final=False, seq_idx=seq_idx)
    torch.testing.assert_close(
        y, run(ssd_chunked_scan_torch, inputs, 64, final=False, seq_idx=seq_idx)
    )


@st.composite
def packed_cases(draw: st.DrawFn) -> tuple[dict[str, torch.Tensor | None], int, torch.Tensor]:
    """An SSD case whose rows are cut into documents at drawn positions."""
    inputs, chunk_size = draw(ssd_cases())
    b, length = inputs["x"].shape[:2]
    rows = []
    for _ in range(b):
        cuts = draw(st.lists(st.integers(1, max(1, length - 1)), max_size=4, unique=True))
        starts = torch.zeros(length, dtype=torch.int64)
        starts[[c for c in cuts if c < length]] = 1
        rows.append(starts.cumsum(0))
    return inputs, chunk_size, torch.stack(rows)


@settings(deadline=None, max_examples=60, derandomize=True)
@given(packed_cases())
def test_documents_chunked_matches_sequential(
    case: tuple[dict[str, torch.Tensor | None], int, torch.Tensor],
) -> None:
    """With seq_idx the chunked scan equals the recurrence that zeroes the state at every
    document start, whatever the chunk size and where the boundaries fall."""
    inputs, chunk_size, seq_idx = case
    y, state = run(ssd_chunked_scan, inputs, chunk_size, seq_idx=seq_idx)
    y_ref, state_ref = run(ssd_sequential_scan, inputs, seq_idx=seq_idx)
    torch.testing.assert_close(y, y_ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(state, state_ref, rtol=1e-10, atol=1e-10)


def test_a_document_scans_as_if_alone() -> None:
    inputs = make_inputs(5, 1, 40, 4, 2, 8, 6)
    seq_idx = torch.tensor([[0] * 13 + [1] * 20 + [2] * 7])
    inputs["initial_state"] = None
    y = run(ssd_chunked_scan, inputs, 8, final=False, seq_idx=seq_idx)
    per_step = {"x", "dt", "B", "C"}
    second = {k: (v[:, 13:33] if k in per_step else v) for k, v in inputs.items()}
    alone = run(ssd_chunked_scan, second, 8, final=False)
    torch.testing.assert_close(y[:, 13:33], alone, rtol=1e-10, atol=1e-10)
    unpacked = run(ssd_chunked_scan, inputs, 8, final=False)
    assert (y[:, 13:33] - unpacked[:, 13:33]).abs().max() > 1e-3


@pytest.mark.parametrize("documents", [False, True])
def test_intra_chunk_backward_matches_autograd(documents: bool) -> None:
    """The within-chunk term's hand-written backward: gradcheck in float64, and the same
    gradients as autograd through the plain sub/masked_fill/exp/mul/matmul graph."""
    gen = torch.Generator().manual_seed(11)
    b, c, g, r, length, p = 2, 2, 2, 2, 5, 3
    cum = -torch.rand(b, c, g, r, length, generator=gen, dtype=torch.float64).cumsum(-1)
    cb = torch.randn(b, c, g, length, length, generator=gen, dtype=torch.float64)
    x_dt = torch.randn(b, c, g, r, length, p, generator=gen, dtype=torch.float64)
    hidden = torch.ones(length, length, dtype=torch.bool).triu(1)
    if documents:  # a document boundary after position 2 of every chunk
        docs = (torch.arange(length) > 2).long()
        hidden = hidden | (docs[:, None] != docs[None, :])
    leaves = [t.clone().requires_grad_() for t in (cum, cb, x_dt)]
    assert torch.autograd.gradcheck(lambda *a: _IntraChunk.apply(*a, hidden), leaves)

    def reference(cum: torch.Tensor, cb: torch.Tensor, x_dt: torch.Tensor) -> torch.Tensor:
        seg = (cum[..., :, None] - cum[..., None, :]).masked_fill(hidden, float("-inf"))
        return torch.matmul(seg.exp() * cb[:, :, :, None], x_dt)

    grads = []
    for fn in (lambda *a: _IntraChunk.apply(*a, hidden), reference):
        args = [t.clone().requires_grad_() for t in (cum, cb, x_dt)]
        fn(*args).sin().sum().backward()
        grads.append([a.grad for a in args])
    for ours, ref in zip(*grads, strict=True):
        torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-12)
