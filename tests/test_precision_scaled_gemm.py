"""Real FP8 GEMMs (``torch._scaled_mm``) for the per-tensor FP8 recipes, and which path runs.

``torch._scaled_mm`` runs on CPU in torch 2.13, so the real path is forced here
(``fp8_gemm.scaled_mm_unavailable`` answers None) and compared with the emulation
on the same quantized operands, for fprop, dgrad and wgrad.

Tolerance. Both paths multiply the same FP8 codes by the same ``scale_inv``s. The
emulation dequantizes each operand in fp32 (one rounding, ``2**-24`` relative per
element) and sums in fp32; the real GEMM sums the code products in fp32 (any order),
multiplies by both scales and rounds once to the output dtype. With ``P = |A| @ |B|``
(the dequantized operands' absolute values, reduction length ``K``) the two fp32
results differ by at most ``d = (K + 4) * 2**-23 * P`` (each sum's rounding error is
below ``K * 2**-24 * P``, the scalings add a few ``2**-24``), and rounding to BF16 adds
half an ulp, ``2**-8`` relative: ``|real - emulated| <= 2**-8 * |emulated| + 2 * d``.
fp32 outputs (the weight gradient of fp32 weights) drop the ``2**-8`` term.

On a GPU the bound gets ``2**-8 * P`` more: Hopper's FP8 tensor cores add products in an
accumulator narrower than fp32 before cuBLAS promotes the partial sums (DeepSeek-V3,
arXiv:2412.19437, section 3.3.2, measured about 14 bits retained), an error no fp32 model
bounds; a wrong layout or scale is still off by the order of ``P``.
"""

from __future__ import annotations

import copy

import pytest
import torch
from precision_helpers import data, run

import factory.kernels.fp8_gemm as fp8_gemm
from factory.checks.validate import load_blueprint
from factory.kernels import fp8
from factory.kernels.choice import KernelChoice
from factory.precision.apply import kernel_choices
from factory.precision.policy import gemm_paths
from factory.precision.quantizers import (
    FP8Quantizer,
    MoRQuantizer,
    MXFP8Quantizer,
    NVFP4Quantizer,
)
from factory.schemas.precision import FP8Options, MoROptions, NVFP4Options

PER_TENSOR = [
    FP8Options(scaling="tensorwise", format="hybrid"),
    FP8Options(scaling="delayed", format="hybrid"),
    FP8Options(scaling="tensorwise", format="e4m3"),
]


def within(
    real: torch.Tensor,
    emulated: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    rounded_to_bf16: bool = True,
    accumulator_slack: float = 0.0,
) -> bool:
    """The module docstring's bound for ``a @ b`` (dequantized operands); ``rounded_to_bf16``:
    the GEMM wrote BF16 (fprop, dgrad), not fp32 (wgrad of fp32 weights);
    ``accumulator_slack``: more error allowed, as a fraction of ``|a| @ |b|``."""
    k = a.shape[-1]
    d = ((k + 4) * 2.0**-23 + accumulator_slack / 2) * (a.abs() @ b.abs())
    rel = 2.0**-8 if rounded_to_bf16 else 0.0
    return bool(((real.float() - emulated).abs() <= rel * emulated.abs() + 2 * d).all())


@pytest.fixture
def scaled_mm_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[torch.dtype, torch.dtype]]:
    """Every ``torch._scaled_mm`` call's operand dtypes, checking its layouts."""
    calls: list[tuple[torch.dtype, torch.dtype]] = []
    real = torch._scaled_mm

    def spy(a: torch.Tensor, b: torch.Tensor, **kw: object) -> torch.Tensor:
        assert a.is_contiguous() and b.t().is_contiguous()  # row-major x column-major
        calls.append((a.dtype, b.dtype))
        return real(a, b, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(torch, "_scaled_mm", spy)
    return calls


@pytest.fixture
def forced(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tensor-core path for CPU tensors (``torch._scaled_mm`` runs on CPU)."""
    monkeypatch.setattr(fp8_gemm, "scaled_mm_unavailable", lambda device: None)


# --- the GEMM itself ---------------------------------------------------------------------


@pytest.mark.parametrize("b_column_major", [True, False])
def test_scaled_matmul_is_the_dequantized_product(b_column_major: bool) -> None:
    x, w, _ = data(0, 32, 64, 48)
    a = fp8.quantize_tensorwise(x, "e4m3")
    b = fp8.quantize_tensorwise(w, "e5m2")
    codes = b.data.t() if b_column_major else b.data.t().contiguous()
    out = fp8_gemm.scaled_matmul(a.data, a.scale_inv, codes, b.scale_inv)
    assert out.dtype == torch.bfloat16 and out.shape == (32, 48)
    emulated = a.dequantize() @ b.dequantize().t()
    assert within(out, emulated, a.dequantize(), b.dequantize().t())
    assert not within(out, a.dequantize() @ b.dequantize()[:, torch.randperm(64)].t(),
                      a.dequantize(), b.dequantize().t())  # fmt: skip


def test_misaligned_names_the_weight_dimensions() -> None:
    assert fp8_gemm.misaligned(64, 48) is None
    assert fp8_gemm.misaligned(60, 40) == "in_features=60, out_features=40 not a multiple of 16"


def test_pad_rows_appends_zero_codes() -> None:
    q = fp8.quantize_tensorwise(torch.randn(2, 5, 32), "e5m2")
    padded = fp8_gemm.pad_rows(q)
    assert padded.data.shape == (2, 16, 32) and padded.data.dtype == q.data.dtype
    assert torch.equal(padded.dequantize()[:, :5], q.dequantize())
    assert not padded.dequantize()[:, 5:].any()
    assert fp8_gemm.pad_rows(padded) is padded


# --- the quantized linear on the real path -----------------------------------------------


@pytest.mark.parametrize("options", PER_TENSOR, ids=lambda o: f"{o.scaling}-{o.format}")
@pytest.mark.parametrize("lead", [(), (3,)], ids=["linear", "experts"])
def test_real_path_equals_the_emulation_on_the_same_operands(
    options: FP8Options, lead: tuple[int, ...], forced: None, scaled_mm_calls: list
) -> None:
    """fprop, dgrad and wgrad each one ``torch._scaled_mm`` (per expert), E4M3 forward and
    E5M2 gradients under hybrid; two steps, so delayed scaling uses a history."""
    real_q, emulated_q = FP8Quantizer(options), FP8Quantizer(options)
    bwd = "e5m2" if options.format == "hybrid" else "e4m3"
    for step in range(2):
        x, w, dy = data(10 + step, 32, 64, 48, lead)
        # the emulation's operands, cast as this step casts them (delayed scaling: from a
        # copy of the history before the step)
        before = copy.deepcopy(emulated_q)
        x_q, w_q, dy_q = before.input(x), before.fprop_weight(w), before.grad(dy)
        y, dx, dw = run(real_q, x, w, dy)
        with pytest.MonkeyPatch.context() as m:
            m.setattr(fp8_gemm, "scaled_mm_unavailable", lambda device: "emulate")
            calls_before = len(scaled_mm_calls)
            y_e, dx_e, dw_e = run(emulated_q, x, w, dy)
            assert len(scaled_mm_calls) == calls_before
        assert y.dtype == x.dtype and dw.dtype == w.dtype
        assert within(y, x_q @ w_q.transpose(-1, -2), x_q, w_q.transpose(-1, -2))
        assert within(dx, dy_q @ w_q, dy_q, w_q)
        dy_t = dy_q.transpose(-1, -2)
        assert within(dw, dy_t @ x_q, dy_t, x_q, rounded_to_bf16=False)
        assert within(y, y_e, x_q, w_q.transpose(-1, -2))
        assert torch.allclose(dx, dx_e, rtol=2**-7, atol=1e-4 * float(dx_e.abs().max()))
        assert torch.allclose(dw, dw_e, rtol=2**-7, atol=1e-4 * float(dw_e.abs().max()))
    experts = lead[0] if lead else 1
    assert scaled_mm_calls[: 3 * experts] == (
        [(torch.float8_e4m3fn, torch.float8_e4m3fn)] * experts
        + [(fp8.FP8_DTYPE[bwd], torch.float8_e4m3fn)] * experts
        + [(fp8.FP8_DTYPE[bwd], torch.float8_e4m3fn)] * experts
    )
    assert len(scaled_mm_calls) == 2 * 3 * experts
    if options.scaling == "delayed":
        assert real_q.delayed["input"].history == emulated_q.delayed["input"].history


def test_real_path_after_the_forward_switch(forced: None, scaled_mm_calls: list) -> None:
    """``switch_to_bf16`` scope forward: fprop unquantized, both backward GEMMs still FP8
    (casting x in the backward); all off: no scaled GEMM at all."""
    q = FP8Quantizer(FP8Options())
    x, w, dy = data(3, 32, 64, 48)
    y, dx, dw = run(q, x, w, dy, fwd=False)
    assert torch.equal(y, x @ w.t())
    x_q, w_q, dy_q = q.input(x), q.weight(w), q.grad(dy)
    assert within(dx, dy_q @ w_q, dy_q, w_q)
    assert within(dw, dy_q.t() @ x_q, dy_q.t(), x_q, rounded_to_bf16=False)
    assert len(scaled_mm_calls) == 2
    run(q, x, w, dy, fwd=False, bwd=False)
    assert len(scaled_mm_calls) == 2


@pytest.mark.parametrize("lead", [(), (2,)], ids=["linear", "experts"])
def test_token_counts_off_16_are_padded(
    lead: tuple[int, ...], forced: None, scaled_mm_calls: list
) -> None:
    """30 tokens: zero rows pad them to 32; the products are the 30 tokens' own."""
    q = FP8Quantizer(FP8Options())
    x, w, dy = data(4, 30, 64, 48, lead)
    y, dx, dw = run(q, x, w, dy)
    assert y.shape == (*lead, 30, 48) and dx.shape == x.shape and dw.shape == w.shape
    assert len(scaled_mm_calls) == 3 * (lead[0] if lead else 1)
    x_q, w_q, dy_q = q.input(x), q.weight(w), q.grad(dy)
    dy_t = dy_q.transpose(-1, -2)
    assert within(y, x_q @ w_q.transpose(-1, -2), x_q, w_q.transpose(-1, -2))
    assert within(dx, dy_q @ w_q, dy_q, w_q)
    assert within(dw, dy_t @ x_q, dy_t, x_q, rounded_to_bf16=False)


def test_misaligned_weights_are_emulated_with_a_warning(
    forced: None, scaled_mm_calls: list
) -> None:
    q, reference = FP8Quantizer(FP8Options()), FP8Quantizer(FP8Options())
    x, w, dy = data(4, 32, 64, 40)
    with pytest.warns(UserWarning, match="out_features=40 not a multiple of 16"):
        got = run(q, x, w, dy)
    assert not scaled_mm_calls
    with pytest.MonkeyPatch.context() as m:
        m.setattr(fp8_gemm, "scaled_mm_unavailable", lambda device: "emulate")
        expected = run(reference, x, w, dy)
    assert all(torch.equal(g, e) for g, e in zip(got, expected, strict=True))


def test_blockwise_stays_emulated_even_where_the_gemm_could_run(
    forced: None, scaled_mm_calls: list
) -> None:
    q = FP8Quantizer(FP8Options(scaling="blockwise"))
    run(q, *data(5, 32, 128, 48))
    assert not scaled_mm_calls and not q.runs_scaled_gemm("cuda")


# --- which path runs, and the report ------------------------------------------------------


def cuda_with(monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int]) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: capability)


def test_cpu_runs_the_emulation_as_the_reference(scaled_mm_calls: list) -> None:
    q = FP8Quantizer(FP8Options())
    assert not q.runs_scaled_gemm("cpu")
    assert q.gemm_kernel("cpu") == KernelChoice("fp8 gemm (tensorwise)", fp8_gemm.EMULATED)
    run(q, *data(6, 32, 64, 48))
    assert not scaled_mm_calls


@pytest.mark.parametrize(
    ("capability", "kernel", "fallback"),
    [
        ((9, 0), fp8_gemm.TENSOR_CORES, None),
        ((8, 9), fp8_gemm.TENSOR_CORES, None),
        ((10, 0), fp8_gemm.TENSOR_CORES, None),
        ((8, 0), fp8_gemm.EMULATED, "compute capability 8.0 < 8.9"),
    ],
)
def test_cuda_dispatch_follows_the_compute_capability(
    monkeypatch: pytest.MonkeyPatch, capability, kernel: str, fallback: str | None
) -> None:
    cuda_with(monkeypatch, capability)
    for scaling in ("tensorwise", "delayed"):
        q = FP8Quantizer(FP8Options(scaling=scaling))
        choice = q.gemm_kernel("cuda")
        assert (choice.kernel, choice.fallback) == (kernel, fallback)
        assert q.runs_scaled_gemm("cuda") == (kernel == fp8_gemm.TENSOR_CORES)


def test_block_scaled_recipes_say_why_they_are_emulated(monkeypatch: pytest.MonkeyPatch) -> None:
    cuda_with(monkeypatch, (10, 0))  # even on Blackwell: the block-scaled path is not built
    quantizers = {
        "mxfp8": MXFP8Quantizer(),
        "nvfp4": NVFP4Quantizer(NVFP4Options()),
        "mor": MoRQuantizer(MoROptions()),
        "fp8": FP8Quantizer(FP8Options(scaling="blockwise")),
    }
    for name, q in quantizers.items():
        choice = q.gemm_kernel("cuda")
        assert choice.kernel == fp8_gemm.EMULATED and choice.fallback, name
        assert not q.runs_scaled_gemm("cuda")
        assert q.gemm_kernel("cpu").fallback is None
    assert "Blackwell" in str(quantizers["mxfp8"].gemm_kernel("cuda").fallback)
    assert "blockwise" in str(quantizers["fp8"].gemm_kernel("cuda").fallback)


def test_kernel_choices_of_a_policy_one_per_recipe(monkeypatch: pytest.MonkeyPatch) -> None:
    cuda_with(monkeypatch, (9, 0))
    super_bp = load_blueprint("super")  # nvfp4 default, mxfp8 overrides, bf16 ends
    choices = kernel_choices(super_bp, "cuda")
    assert [c.op for c in choices] == ["nvfp4 gemm", "mxfp8 gemm"]
    assert all(c.fallback and "Blackwell" in c.fallback for c in choices)
    fp8_bp = super_bp.model_copy(
        update={"precision": super_bp.precision.model_copy(update={"recipe": "fp8"})}
    )
    ops = {c.op: c for c in kernel_choices(fp8_bp, "cuda")}
    assert ops["fp8 gemm (tensorwise)"] == KernelChoice(
        "fp8 gemm (tensorwise)", fp8_gemm.TENSOR_CORES
    )
    assert kernel_choices(fp8_bp, "cpu")[0].fallback is None


def test_the_plan_says_which_gemms_run_on_tensor_cores() -> None:
    super_bp = load_blueprint("super")
    lines = gemm_paths(super_bp)
    assert len(lines) == 2 and all("emulated" in line and "Blackwell" in line for line in lines)
    h100_fp8 = super_bp.model_copy(
        update={
            "precision": super_bp.precision.model_copy(update={"recipe": "fp8", "overrides": {}}),
            "parallelism": super_bp.parallelism.model_copy(update={"gpu": "h100"}),
        }
    )
    assert gemm_paths(h100_fp8) == [
        "fp8: fprop, dgrad and wgrad on h100's fp8 tensor cores (torch._scaled_mm)"
    ]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_real_gemms_equal_the_emulation() -> None:
    """On the GPU the dispatch takes ``torch._scaled_mm`` by itself; same bound."""
    if torch.cuda.get_device_capability() < fp8_gemm.MIN_CAPABILITY:
        pytest.skip("needs a CUDA GPU with FP8 tensor cores")
    q = FP8Quantizer(FP8Options())
    assert q.runs_scaled_gemm("cuda")
    x, w, dy = (t.cuda() for t in data(7, 64, 128, 96))
    y, dx, dw = run(q, x, w, dy)
    x_q, w_q, dy_q = q.input(x), q.weight(w), q.grad(dy)
    slack = 2.0**-8  # see the module docstring: Hopper's narrower FP8 accumulator
    assert within(y, x_q @ w_q.t(), x_q, w_q.t(), accumulator_slack=slack)
    assert within(dx, dy_q @ w_q, dy_q, w_q, accumulator_slack=slack)
    assert within(dw, dy_q.t() @ x_q, dy_q.t(), x_q, False, accumulator_slack=slack)


def test_the_installed_runtime_lists_its_recipes_choices(monkeypatch: pytest.MonkeyPatch) -> None:
    """``PrecisionRuntime.kernel_choices``: one per recipe installed, asked of its quantizers;
    the same as the blueprint's before any model is built."""
    import factory
    from factory.precision.apply import apply_precision

    bp = load_blueprint("super", ["precision.recipe=fp8"])  # fp8 linears, mxfp8 overrides
    compiled = factory.compile(bp, proxy=True, device="meta", precision="off")
    bp = compiled.blueprint  # the proxy's
    runtime = apply_precision(compiled.model, bp)
    assert [c.op for c in runtime.kernel_choices("cpu")] == ["fp8 gemm (tensorwise)", "mxfp8 gemm"]
    assert all(c.fallback is None for c in runtime.kernel_choices("cpu"))
    cuda_with(monkeypatch, (9, 0))
    fp8_choice, mx_choice = runtime.kernel_choices("cuda")
    assert fp8_choice.kernel == fp8_gemm.TENSOR_CORES and fp8_choice.fallback is None
    assert mx_choice.kernel == fp8_gemm.EMULATED and "Blackwell" in str(mx_choice.fallback)
    assert runtime.kernel_choices("cuda") == kernel_choices(bp, "cuda")
