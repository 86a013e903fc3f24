"""The three expert GEMM paths (padded bmm, torch._grouped_mm, per-expert mm) agree with a
per-token float64 reference, forward and backward, for any load, empty experts included."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from factory.kernels.moe_dispatch import grouped_mm_works, route_tokens
from factory.layers.moe.experts import PATHS, ExpertPath, choose_path
from factory.layers.moe.module import RoutedExperts


def reference(
    x: torch.Tensor,
    index: torch.Tensor,
    weights: torch.Tensor,
    up: torch.Tensor,
    down: torch.Tensor,
    gate: torch.Tensor | None,
) -> torch.Tensor:
    """The definition in float64, one (token, slot) pair at a time."""
    rows = []
    for t in range(x.shape[0]):
        acc = torch.zeros_like(x[t])
        for j in range(index.shape[1]):
            e = int(index[t, j])
            h = up[e] @ x[t]
            h = torch.relu(h) ** 2 if gate is None else F.silu(gate[e] @ x[t]) * h
            acc = acc + weights[t, j] * (down[e] @ h)
        rows.append(acc)
    return torch.stack(rows) if rows else x.new_zeros(0, x.shape[1])


def skewed_index(seed: int, tokens: int, experts: int, k: int, hot: int) -> torch.Tensor:
    """[T, k] distinct experts per token; the first ``hot`` experts are preferred strongly
    (hot = 0: uniform), and with experts > k some experts may receive nothing."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.zeros(experts)
    logits[:hot] = 4.0
    probs = logits.softmax(0).expand(tokens, experts)
    return torch.multinomial(probs, k, replacement=False, generator=gen)


def run_path(
    path: ExpertPath, module: RoutedExperts, x: torch.Tensor, index: torch.Tensor, w: torch.Tensor
) -> list[torch.Tensor]:
    """Output and the gradients of x, weights and every expert weight through one path."""
    module.zero_grad(set_to_none=True)
    module.path = path
    xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
    out = module(xl, route_tokens(index, module.up_proj.shape[0]), wl)
    out.backward(torch.cos(torch.arange(out.numel(), dtype=out.dtype)).view_as(out))
    # A tensor no path reached (no tokens, or an expert with none) has a zero gradient.
    leaves = [xl, wl, *module.parameters()]
    grads = [t.grad if t.grad is not None else torch.zeros_like(t) for t in leaves]
    return [out.detach(), *grads]


def paths_here() -> list[ExpertPath]:
    """grouped_mm only where this torch build has a working one for CPU fp32."""
    return [p for p in PATHS if p != "grouped_mm" or grouped_mm_works("cpu", torch.float32)]


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    tokens=st.integers(0, 40),
    experts=st.integers(1, 8),
    k=st.integers(1, 3),
    hot=st.integers(0, 3),
    swiglu=st.booleans(),
)
def test_paths_match_reference(
    seed: int, tokens: int, experts: int, k: int, hot: int, swiglu: bool
) -> None:
    k = min(k, experts)
    torch.manual_seed(seed)
    module = RoutedExperts(experts, 8, 16, "swiglu" if swiglu else "relu2")
    for p in module.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(tokens, 8)
    w = torch.rand(tokens, k)
    index = skewed_index(seed, tokens, experts, k, hot)
    # The float64 reference, forward and backward, on the same values.
    params64 = [p.detach().double().requires_grad_() for p in module.parameters()]
    x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
    up, gate, down = (
        (params64[0], params64[1], params64[2]) if swiglu else (*params64[:1], None, params64[1])
    )
    ref = reference(x64, index, w64, up, down, gate)
    if ref.requires_grad:  # not with no tokens at all
        ref.backward(torch.cos(torch.arange(ref.numel(), dtype=ref.dtype)).view_as(ref))
    leaves = [x64, w64, *params64]
    expected = [
        ref.detach(),
        *(t.grad if t.grad is not None else torch.zeros_like(t) for t in leaves),
    ]
    for path in paths_here():
        got = run_path(path, module, x, index, w)
        for a, b in zip(got, expected, strict=True):
            torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-4, msg=path)


def test_choose_path_by_load() -> None:
    """CPU: grouped_mm wherever it works (fp32); without it (fp64) padded bmm while the load
    is even and per-expert mm once a hot expert makes the padding large."""
    balanced = torch.arange(512 * 2).view(512, 2) % 8
    hot = skewed_index(0, 512, 8, 2, hot=1)
    for index in (balanced, hot):
        expected = "grouped_mm" if grouped_mm_works("cpu", torch.float32) else None
        if expected:
            assert choose_path(route_tokens(index, 8), torch.randn(1, 8), 16) == expected
    x64 = torch.randn(1, 8, dtype=torch.float64)
    assert choose_path(route_tokens(balanced, 8), x64, 16) == "padded_bmm"
    assert choose_path(route_tokens(hot, 8), x64, 16) == "per_expert"


def test_quantized_linear_keeps_padded_path() -> None:
    """An installed expert GEMM (precision emulation) takes padded [E, C, in] batches."""
    module = RoutedExperts(4, 8, 16, "relu2")
    for p in module.parameters():
        torch.nn.init.normal_(p, std=0.3)
    seen: list[tuple[int, ...]] = []

    def linear(name: str, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        seen.append(tuple(x.shape))
        return torch.bmm(x, w.transpose(1, 2))

    module.linear = linear
    index = skewed_index(0, 32, 4, 2, hot=1)
    module(torch.randn(32, 8), route_tokens(index, 4), None)
    assert seen and all(len(shape) == 3 and shape[0] == 4 for shape in seen)


@pytest.mark.skipif(not grouped_mm_works("cpu", torch.float32), reason="no CPU _grouped_mm")
def test_grouped_mm_gives_bitwise_equal_gradients_to_per_expert() -> None:
    """Both unpadded paths multiply the same rows; on CPU they round the same way."""
    torch.manual_seed(0)
    module = RoutedExperts(8, 16, 32, "relu2")
    for p in module.parameters():
        torch.nn.init.normal_(p, std=0.2)
    index = skewed_index(1, 64, 8, 2, hot=2)
    x, w = torch.randn(64, 16), torch.rand(64, 2)
    a = run_path("grouped_mm", module, x, index, w)
    b = run_path("per_expert", module, x, index, w)
    for ta, tb in zip(a, b, strict=True):
        torch.testing.assert_close(ta, tb, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("path", PATHS)
def test_fp32_masters_compute_in_the_activation_dtype(path: ExpertPath) -> None:
    """Experts FSDP leaves alone (one expert-data-parallel replica) keep fp32 weights while the
    block computes in BF16: every path runs in BF16 and the fp32 masters get their gradients."""
    if path == "grouped_mm" and not grouped_mm_works("cpu", torch.bfloat16):
        pytest.skip("torch._grouped_mm does not run in BF16 on this CPU build")
    torch.manual_seed(0)
    module = RoutedExperts(4, 8, 16, "relu2")
    for p in module.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(6, 8, dtype=torch.bfloat16)
    index = skewed_index(0, 6, 4, 2, hot=0)
    weights = torch.rand(6, 2, dtype=torch.bfloat16)
    outputs = run_path(path, module, x, index, weights)
    assert outputs[0].dtype == torch.bfloat16
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in module.parameters())
    half = RoutedExperts(4, 8, 16, "relu2").to(torch.bfloat16)
    half.load_state_dict(module.state_dict())
    expected = run_path(path, half, x, index, weights)
    torch.testing.assert_close(outputs[0], expected[0], rtol=0, atol=0)
