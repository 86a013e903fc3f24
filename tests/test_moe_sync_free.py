"""The sync-free MoE dispatch: ``torch._grouped_mm`` over the expert-sorted pairs equals the
padded-bmm reference for any routing (empty experts included), forward and backward; the MoE
block traces into one graph (``fullgraph=True``: a host read or a shape the data decides
would break it) and the compiled block gives the eager one's results; two runs agree bit for
bit; and the kernel report says which path runs."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from factory.kernels import moe_dispatch
from factory.kernels.moe_dispatch import (
    ExpertWeights,
    grouped_mlp,
    grouped_mm_problem,
    grouped_mm_works,
    route_tokens,
)
from factory.layers.moe.module import MoE, RoutedExperts, kernel_choices
from factory.loading.blueprint import read_blueprint, resolve_source
from factory.nn.outputs import RoutedOutput
from factory.schemas.model import MoEConfig, RouterConfig

BF16 = torch.bfloat16
needs_grouped_mm = pytest.mark.skipif(
    not (grouped_mm_works("cpu", torch.float32) and grouped_mm_works("cpu", BF16)),
    reason="torch._grouped_mm does not run on this CPU build",
)


def _routing(seed: int, tokens: int, experts: int, k: int, used: int) -> torch.Tensor:
    """[T, k] distinct experts per token, drawn from the first ``used`` experts only (the
    others get nothing)."""
    gen = torch.Generator().manual_seed(seed)
    rows = [torch.randperm(used, generator=gen)[:k] for _ in range(tokens)]
    return torch.stack(rows) if rows else torch.zeros(0, k, dtype=torch.long)


def _outputs(impl: str, x: torch.Tensor, index: torch.Tensor, w: torch.Tensor,
             params: list[torch.Tensor], experts: int) -> list[torch.Tensor]:  # fmt: skip
    """grouped_mlp's output and the gradients of x, the routing weights and the expert
    weights, for the loss sum(y * cos)."""
    leaves = [t.detach().clone().requires_grad_() for t in (x, w, *params)]
    xl, wl, up, down, *gate = leaves
    weights = ExpertWeights(up, down, "swiglu" if gate else "relu2", gate[0] if gate else None)
    y = grouped_mlp(xl, route_tokens(index, experts, check=False), weights, wl, impl=impl)
    y.backward(torch.cos(torch.arange(y.numel(), dtype=y.dtype)).view_as(y))
    return [y.detach(), *(t.grad if t.grad is not None else torch.zeros_like(t) for t in leaves)]


@needs_grouped_mm
@settings(max_examples=40, deadline=None, derandomize=True)
@given(
    seed=st.integers(0, 2**16),
    tokens=st.integers(0, 24),
    experts=st.integers(1, 8),
    k=st.integers(1, 3),
    used=st.integers(1, 8),
    swiglu=st.booleans(),
)
def test_grouped_mm_path_equals_padded_bmm(
    seed: int, tokens: int, experts: int, k: int, used: int, swiglu: bool
) -> None:
    """fp32: the same products per pair; the GEMM kernels differ (one ragged GEMM against a
    batched one over zero padding), so the sums may round apart in the last bits: 1e-5
    relative. The combine is the same fp32 sum over slots on both paths."""
    used = min(max(used, k), experts)
    k = min(k, used)
    gen = torch.Generator().manual_seed(seed + 1)
    d, ff = 8, 16
    x = torch.randn(tokens, d, generator=gen)
    w = torch.rand(tokens, k, generator=gen)
    params = [torch.randn(experts, ff, d, generator=gen) / 2,
              torch.randn(experts, d, ff, generator=gen) / 4]  # fmt: skip
    if swiglu:
        params.append(torch.randn(experts, ff, d, generator=gen) / 2)
    index = _routing(seed, tokens, experts, k, used)
    grouped = _outputs("grouped_mm", x, index, w, params, experts)
    padded = _outputs("bmm", x, index, w, params, experts)
    for a, b in zip(grouped, padded, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def _moe(dtype: torch.dtype = BF16, **cfg: object) -> MoE:
    """A small MoE layer in ``dtype`` (router in fp32, as factory.compile casts it): 8
    experts, top-2, aligned widths, a shared expert, sigmoid scores with an expert bias and
    the sequence-wise aux loss; ``cfg`` overrides MoEConfig fields."""
    router = RouterConfig(score_function="sigmoid", expert_bias=True, aux_loss="seq_aux_loss",
                          aux_loss_coeff=1e-2, **cfg.pop("router", {}))  # fmt: skip
    fields = {"num_experts": 8, "top_k": 2, "expert_intermediate_size": 32,
              "shared_expert_intermediate_size": 16, "activation": "relu2", "router": router}  # fmt: skip
    torch.manual_seed(0)
    module = MoE(16, MoEConfig(**{**fields, **cfg}), mlp_bias=False)
    for p in module.parameters():
        torch.nn.init.normal_(p, std=0.2)
    with torch.no_grad():  # a bias that changes the choice, as a trained one does
        module.gate.e_score_correction_bias.copy_(torch.linspace(-0.3, 0.3, 8))
    module.to(dtype)
    module.gate.float()
    return module.train()


def _run(module: torch.nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    """Output, aux loss, load and every gradient, for the loss sum(y * cos) + aux."""
    module.zero_grad(set_to_none=True)
    xl = x.clone().requires_grad_()
    out: RoutedOutput = module(xl)
    probe = torch.arange(out.y.numel(), dtype=torch.float32, device=out.y.device)
    probe = torch.cos(probe).view_as(out.y)
    ((out.y.float() * probe).sum() + out.aux_loss).backward()
    grads = [p.grad for p in module.parameters() if p.requires_grad]
    return [out.y.detach(), out.aux_loss.detach(), out.tokens_per_expert, xl.grad, *grads]


CONFIGS = {
    "plain": {},
    "fp32": {"dtype": torch.float32},
    "latent": {"latent_size": 8},
    "swiglu": {"activation": "swiglu"},
    "capacity": {"capacity_factor": 1.0},
    "groups": {"router": {"num_groups": 4, "group_top_k": 2}},
}


@needs_grouped_mm
@pytest.mark.parametrize("name", list(CONFIGS))
def test_moe_block_traces_in_one_graph_and_equals_eager(name: str) -> None:
    """``fullgraph=True`` fails on any graph break: a ``.item()``/``.tolist()``, a boolean
    mask or ``nonzero`` with a data-dependent size. aot_eager runs the traced graph's ops
    unfused, so it equals eager bit for bit. BF16 traces ``_grouped_mm`` itself; fp32, which
    its meta kernel refuses, through factory's opaque op over the same kernel."""
    module = _moe(**CONFIGS[name])
    assert module.sync_free()
    dtype = module.experts.up_proj.dtype
    x = torch.randn(2, 24, 16, generator=torch.Generator().manual_seed(1)).to(dtype)
    eager = _run(module, x)
    torch._dynamo.reset()
    traced = torch.compile(module, fullgraph=True, backend="aot_eager", dynamic=False)
    compiled = _run(traced, x)
    assert int(eager[2].sum()) == 2 * 24 * 2  # every pair counted, none read on the host
    for a, b in zip(eager, compiled, strict=True):
        assert torch.equal(a, b)


@needs_grouped_mm
def test_inductor_compiled_block_matches_eager() -> None:
    """Inductor fuses the elementwise passes in BF16, rounding differently: within BF16's
    precision (2**-7 relative to each tensor's largest magnitude); the load is exact."""
    module = _moe()
    x = torch.randn(2, 24, 16, generator=torch.Generator().manual_seed(2)).to(BF16)
    eager = _run(module, x)
    torch._dynamo.reset()
    compiled = _run(torch.compile(module, fullgraph=True, dynamic=False), x)
    assert torch.equal(eager[2], compiled[2])
    for a, b in zip(eager, compiled, strict=True):
        scale = a.float().abs().max().clamp_min(1e-6)
        assert float((a.float() - b.float()).abs().max()) <= 2**-7 * float(scale)


@needs_grouped_mm
def test_two_runs_are_bitwise_equal() -> None:
    """No atomics on the path: the pairs are sorted and unsorted by gathers, whose gradients
    are gathers (each token's k slot gradients summed in slot order), and the combine is a
    fixed-order sum over slots."""
    x = torch.randn(3, 16, 16, generator=torch.Generator().manual_seed(3)).to(BF16)
    first, second = _run(_moe(), x), _run(_moe(), x)
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)


@needs_grouped_mm
def test_route_tokens_unchecked_matches_checked_and_reads_nothing(monkeypatch) -> None:
    """``check=False`` gives the same layout with no host read: ``tolist``, ``item`` and
    ``int()`` on a tensor would raise here."""
    index = _routing(4, 30, 8, 3, used=6)  # experts 6 and 7 empty
    checked = route_tokens(index, 8)

    def refuse(*args: object) -> None:
        raise AssertionError("host read")

    for name in ("tolist", "item", "__int__", "__bool__"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    unchecked = route_tokens(index, 8, check=False)
    offsets = unchecked.offsets
    monkeypatch.undo()
    for field in ("order", "inverse_order", "token_index", "expert_index", "rank_in_expert",
                  "tokens_per_expert"):  # fmt: skip
        assert torch.equal(getattr(checked, field), getattr(unchecked, field)), field
    assert offsets.dtype == torch.int32
    assert (
        offsets.tolist() == torch.cumsum(torch.bincount(index.flatten(), minlength=8), 0).tolist()
    )


def test_blocks_that_would_sync_are_not_sync_free() -> None:
    """fp64 (no ``_grouped_mm``), unaligned widths (its kernels refuse them), a quantized
    GEMM hook (padded batches), a forced padded path: each keeps the block eager."""
    assert not _moe(torch.float64).sync_free()
    assert not _moe(expert_intermediate_size=30).sync_free()
    hooked = _moe()
    hooked.experts.linear = lambda name, x, w: torch.bmm(x, w.transpose(1, 2))
    assert not hooked.sync_free()
    forced = _moe()
    forced.experts.path = "padded_bmm"
    assert not forced.sync_free()
    assert grouped_mm_problem("cpu", BF16, 12, 32) is not None  # 24-byte rows


def test_expert_module_takes_the_path_the_report_names(monkeypatch) -> None:
    """The dispatch and the report answer from one test: where ``_grouped_mm`` is verified
    both name it; where the probe fails, CPU takes the padded path and reports no fallback
    (its PyTorch paths are the reference), CUDA reports the fallback and why."""
    blueprint, _ = read_blueprint(resolve_source("nano"))
    model = blueprint.model
    taken: list[str] = []
    real = moe_dispatch.grouped_mm_sorted

    def spy(*args: object) -> torch.Tensor:
        taken.append("grouped_mm")
        return real(*args)

    monkeypatch.setattr("factory.layers.moe.experts.grouped_mm_sorted", spy)
    experts = RoutedExperts(4, 8, 16, "relu2")
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.3)
    index = _routing(0, 12, 4, 2, used=4)
    if grouped_mm_works("cpu", torch.float32):
        experts(torch.randn(12, 8), route_tokens(index, 4), None)
        assert taken == ["grouped_mm"]
        assert "torch._grouped_mm" in kernel_choices(model, "cpu")[1].kernel
    monkeypatch.setitem(moe_dispatch._GROUPED_MM_WORKS, ("cpu", torch.float32), False)
    monkeypatch.setitem(moe_dispatch._GROUPED_MM_WORKS, ("cuda", BF16), False)
    taken.clear()
    experts(torch.randn(12, 8), route_tokens(index, 4), None)
    assert taken == []
    cpu = kernel_choices(model, "cpu")
    assert all(c.fallback is None for c in cpu) and "host" in cpu[0].kernel
    cuda = kernel_choices(model, "cuda")
    assert all(c.fallback and "_grouped_mm" in c.fallback for c in cuda)
    monkeypatch.setitem(moe_dispatch._GROUPED_MM_WORKS, ("cuda", BF16), True)
    cuda = kernel_choices(model, "cuda")
    assert all(c.fallback is None for c in cuda) and "no host sync" in cuda[0].kernel


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_block_makes_no_host_sync() -> None:
    """On the device: forward and backward of the MoE block under
    ``torch.cuda.set_sync_debug_mode("error")``, which raises on any synchronizing call; the
    results equal the padded-bmm path's within BF16 rounding (2**-6 of each tensor's largest
    magnitude: the GEMM kernels differ)."""
    module = _moe().cuda()
    if not module.sync_free():
        pytest.skip(f"no sync-free path: {grouped_mm_problem('cuda', BF16, 16, 32)}")
    x = torch.randn(2, 64, 16, device="cuda", dtype=BF16)
    _run(module, x)  # warm-up: caches, lazy inits
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = _run(module, x)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    module.experts.path = "padded_bmm"  # the reference, on the same device and routing
    reference = _run(module, x)
    for a, b in zip(out, reference, strict=True):
        scale = b.float().abs().max().clamp_min(1e-6)
        assert float((a.float() - b.float()).abs().max()) <= 2**-6 * float(scale)


def test_the_grouped_mm_probe_answers_the_same_under_no_grad(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Asked first by a no-grad forward (evaluation, decoding), the probe still runs its backward.
    monkeypatch.setattr(moe_dispatch, "_GROUPED_MM_WORKS", {})
    with torch.no_grad():
        under_no_grad = moe_dispatch.grouped_mm_works("cpu", torch.float32)
    monkeypatch.setattr(moe_dispatch, "_GROUPED_MM_WORKS", {})
    with torch.inference_mode():
        under_inference = moe_dispatch.grouped_mm_works("cpu", torch.float32)
    monkeypatch.setattr(moe_dispatch, "_GROUPED_MM_WORKS", {})
    assert under_no_grad is under_inference is moe_dispatch.grouped_mm_works("cpu", torch.float32)
    assert under_no_grad  # torch 2.13's CPU kernel runs and matches bmm
