"""Grouped MoE dispatch vs a naive per-token loop and vs transformers' NemotronHExperts."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from factory.kernels.moe_dispatch import (
    Dispatch,
    ExpertWeights,
    grouped_mlp,
    grouped_mm_works,
    relu_squared,
    route_tokens,
)


def naive_moe(
    x: torch.Tensor,
    index: torch.Tensor,
    weights: torch.Tensor | None,
    up: torch.Tensor,
    down: torch.Tensor,
    activation: str,
    gate: torch.Tensor | None = None,
) -> torch.Tensor:
    """One token and one slot at a time: the definition, no batching."""
    rows = []
    for t in range(x.shape[0]):
        acc = torch.zeros_like(x[t])
        for j in range(index.shape[1]):
            e = int(index[t, j])
            h = up[e] @ x[t]
            h = torch.relu(h) ** 2 if activation == "relu2" else F.silu(gate[e] @ x[t]) * h
            w = 1.0 if weights is None else weights[t, j]
            acc = acc + w * (down[e] @ h)
        rows.append(acc)
    return torch.stack(rows) if rows else x.new_zeros(0, x.shape[1])


def make_weights(
    seed: int, experts: int, d_in: int, ff: int, dtype: torch.dtype = torch.float64
) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        name: (torch.randn(*shape, generator=gen, dtype=torch.float64) / 2).to(dtype)
        for name, shape in {
            "up": (experts, ff, d_in),
            "down": (experts, d_in, ff),
            "gate": (experts, ff, d_in),
        }.items()
    }


def routing(seed: int, tokens: int, experts: int, k: int, mode: str) -> torch.Tensor:
    """[T, k] distinct experts per token, as a top-k router produces."""
    gen = torch.Generator().manual_seed(seed)
    if mode == "one_expert":  # every token on the same expert (k == 1)
        return torch.full((tokens, 1), experts - 1, dtype=torch.long)
    if mode == "narrow":  # only the first experts used, the rest get nothing
        used = max(k, (experts + 1) // 2)
        return torch.stack([torch.randperm(used, generator=gen)[:k] for _ in range(tokens)])
    rows = [torch.randperm(experts, generator=gen)[:k] for _ in range(tokens)]
    return torch.stack(rows) if rows else torch.zeros(0, k, dtype=torch.long)


@st.composite
def moe_cases(draw: st.DrawFn) -> dict:
    experts = draw(st.integers(1, 6))
    mode = draw(st.sampled_from(["random", "narrow", "one_expert", "all_experts"]))
    k = {"one_expert": 1, "all_experts": experts}.get(mode) or draw(st.integers(1, experts))
    return {
        "seed": draw(st.integers(0, 2**16)),
        "tokens": draw(st.integers(1, 12)),
        "experts": experts,
        "k": k,
        "mode": mode,
        "d_in": draw(st.integers(1, 8)),
        "ff": draw(st.integers(1, 8)),
        "activation": draw(st.sampled_from(["relu2", "swiglu"])),
        "weighted": draw(st.booleans()) or mode == "random",
    }


def build(case: dict, dtype: torch.dtype = torch.float64) -> dict:
    gen = torch.Generator().manual_seed(case["seed"] + 1)
    tokens, k = case["tokens"], case["k"]
    params = make_weights(case["seed"], case["experts"], case["d_in"], case["ff"], dtype)
    return {
        "x": torch.randn(tokens, case["d_in"], generator=gen, dtype=torch.float64).to(dtype),
        "index": routing(case["seed"], tokens, case["experts"], k, case["mode"]),
        "weights": torch.rand(tokens, k, generator=gen, dtype=torch.float64).to(dtype)
        if case["weighted"]
        else None,
        "up": params["up"],
        "down": params["down"],
        "gate": params["gate"] if case["activation"] == "swiglu" else None,
    }


def call_grouped(t: dict, case: dict, **kw) -> torch.Tensor:
    dispatch = route_tokens(t["index"], case["experts"])
    experts = ExpertWeights(t["up"], t["down"], case["activation"], t["gate"])
    return grouped_mlp(t["x"], dispatch, experts, t["weights"], **kw)


def call_naive(t: dict, case: dict) -> torch.Tensor:
    return naive_moe(
        t["x"], t["index"], t["weights"], t["up"], t["down"], case["activation"], t["gate"]
    )


@settings(deadline=None, max_examples=60, derandomize=True)
@given(moe_cases())
def test_grouped_matches_naive(case: dict) -> None:
    t = build(case)
    y = call_grouped(t, case)
    assert y.shape == t["x"].shape and y.dtype == t["x"].dtype
    torch.testing.assert_close(y, call_naive(t, case), rtol=1e-10, atol=1e-10)


@settings(deadline=None, max_examples=20, derandomize=True)
@given(moe_cases())
def test_gradients_match_naive(case: dict) -> None:
    names = ["x", "up", "down", "gate", "weights"]
    grads = []
    for fn in (call_grouped, call_naive):
        t = build(case)
        leaves = [t[n].requires_grad_() for n in names if t[n] is not None]
        fn(t, case).sin().sum().backward()
        grads.append([leaf.grad for leaf in leaves])
    for g_grouped, g_naive in zip(*grads, strict=True):
        torch.testing.assert_close(g_grouped, g_naive, rtol=1e-10, atol=1e-10)


def test_route_tokens_layout() -> None:
    index = torch.tensor([[2, 0], [0, 3], [2, 0]])
    d = route_tokens(index, num_experts=5)
    assert isinstance(d, Dispatch)
    assert d.tokens_per_expert.tolist() == [3, 0, 2, 1, 0]
    assert d.max_tokens_per_expert == 3
    # Stable: equal experts keep router order (token-major, then slot).
    assert d.order.tolist() == [1, 2, 5, 0, 4, 3]
    assert d.expert_index.tolist() == [0, 0, 0, 2, 2, 3]
    assert d.token_index.tolist() == [0, 1, 2, 0, 2, 1]
    assert d.slot_index.tolist() == [1, 0, 1, 0, 0, 1]
    assert d.rank_in_expert.tolist() == [0, 1, 2, 0, 1, 0]
    flat = index.reshape(-1)
    assert torch.equal(d.unpermute(flat[d.order]), index)
    assert torch.equal(d.order[d.inverse_order], torch.arange(6))


def test_route_tokens_rejects_bad_indices() -> None:
    with pytest.raises(ValueError, match=r"\[0, 4\)"):
        route_tokens(torch.tensor([[0, 4]]), 4)
    with pytest.raises(ValueError, match=r"\[0, 4\)"):
        route_tokens(torch.tensor([[-1, 2]]), 4)
    with pytest.raises(ValueError, match="integer"):
        route_tokens(torch.zeros(2, 1), 4)


def test_argument_errors() -> None:
    case = {"seed": 0, "tokens": 3, "experts": 2, "k": 1, "mode": "random", "d_in": 4, "ff": 3}
    t = build({**case, "activation": "relu2", "weighted": True})
    d = route_tokens(t["index"], 2)
    with pytest.raises(ValueError, match="gate is required"):
        ExpertWeights(t["up"], t["down"], "swiglu")
    with pytest.raises(ValueError, match="activation"):
        ExpertWeights(t["up"], t["down"], "gelu")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="down"):
        ExpertWeights(t["up"], t["down"].transpose(1, 2))
    experts = ExpertWeights(t["up"], t["down"])
    with pytest.raises(ValueError, match="tokens"):
        grouped_mlp(t["x"][:2], d, experts)
    with pytest.raises(ValueError, match="expected up"):
        grouped_mlp(t["x"], route_tokens(t["index"], 3), experts)


def test_no_tokens() -> None:
    case = {"seed": 0, "tokens": 0, "experts": 3, "k": 2, "mode": "random", "d_in": 4, "ff": 5}
    case |= {"activation": "relu2", "weighted": True}
    t = build(case)
    y = call_grouped(t, case)
    assert y.shape == (0, 4)


def test_matches_transformers_nemotron_h_experts() -> None:
    transformers = pytest.importorskip("transformers")
    modeling = pytest.importorskip("transformers.models.nemotron_h.modeling_nemotron_h")
    tokens, experts, k, d_in, ff = 20, 8, 3, 16, 24
    config = transformers.NemotronHConfig(
        hidden_size=d_in, moe_intermediate_size=ff, n_routed_experts=experts, num_experts_per_tok=k
    )
    config._experts_implementation = "eager"  # the reference per-expert loop
    assert config.mlp_hidden_act == "relu2"
    hf = modeling.NemotronHExperts(config)
    params = make_weights(11, experts, d_in, ff, torch.float32)
    with torch.no_grad():
        hf.up_proj.copy_(params["up"])
        hf.down_proj.copy_(params["down"])
    gen = torch.Generator().manual_seed(12)
    x = torch.randn(tokens, d_in, generator=gen)
    index = torch.stack([torch.randperm(experts - 2, generator=gen)[:k] for _ in range(tokens)])
    weights = torch.rand(tokens, k, generator=gen)
    with torch.no_grad():
        expected = hf(x, index, weights)
    got = grouped_mlp(
        x, route_tokens(index, experts), ExpertWeights(params["up"], params["down"]), weights
    )
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_deterministic() -> None:
    case = {"seed": 3, "tokens": 64, "experts": 6, "k": 2, "mode": "random", "d_in": 16, "ff": 32}
    case |= {"activation": "swiglu", "weighted": True}
    t = build(case, torch.float32)
    first = call_grouped(t, case)
    second = call_grouped(t, case)
    assert torch.equal(first, second)
    d1, d2 = route_tokens(t["index"], 6), route_tokens(t["index"], 6)
    assert torch.equal(d1.order, d2.order)


def test_bf16_accumulates_in_fp32() -> None:
    case = {"seed": 4, "tokens": 16, "experts": 4, "k": 2, "mode": "random", "d_in": 8, "ff": 8}
    case |= {"activation": "relu2", "weighted": True}
    t = build(case, torch.bfloat16)
    y = call_grouped(t, case)
    assert y.dtype == torch.bfloat16
    ref = call_naive({k: None if v is None else v.double() for k, v in t.items()}, case)
    torch.testing.assert_close(y.double(), ref, rtol=5e-2, atol=5e-2)


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch has no _grouped_mm")
@pytest.mark.parametrize("activation", ["relu2", "swiglu"])
def test_grouped_mm_path_matches_bmm(activation: str) -> None:
    """The optional torch._grouped_mm path equals padded bmm, forward and backward."""
    if not grouped_mm_works("cpu", torch.float32):
        pytest.skip("torch._grouped_mm does not work on this CPU build")
    case = {"seed": 5, "tokens": 24, "experts": 5, "k": 2, "mode": "narrow", "d_in": 16, "ff": 32}
    case |= {"activation": activation, "weighted": True}
    names = ["x", "up", "down", "gate", "weights"]
    results = []
    for impl in ("grouped_mm", "bmm"):
        t = build(case, torch.float32)
        leaves = [t[n].requires_grad_() for n in names if t[n] is not None]
        y = call_grouped(t, case, impl=impl)
        y.square().sum().backward()
        results.append([y, *(leaf.grad for leaf in leaves)])
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_relu_squared_gradient_is_autograds() -> None:
    """The written-out backward gives autograd's gradient bit for bit, and passes gradcheck."""
    gen = torch.Generator().manual_seed(4)
    h = torch.randn(64, 33, generator=gen)
    h[0, :4] = 0.0  # relu's kink: both give 0 there
    upstream = torch.randn(h.shape, generator=gen)
    ours, ref = h.clone().requires_grad_(), h.clone().requires_grad_()
    out = relu_squared(ours)
    expected = F.relu(ref).square()
    assert torch.equal(out, expected)
    out.backward(upstream)
    expected.backward(upstream)
    assert torch.equal(ours.grad, ref.grad)
    h64 = torch.randn(5, 7, generator=gen, dtype=torch.float64).requires_grad_()
    assert torch.autograd.gradcheck(relu_squared, (h64,))
