"""The Triton quantization kernels against the PyTorch emulation, bit for bit, on CPU.

The kernels run under Triton's interpreter (``TRITON_INTERPRET=1``, numpy), which
the ``kernels`` fixture switches on for this module's tests: ``triton.jit`` picks the
interpreter when a kernel is defined and Triton reads the variable again when it
runs, so it is set before the kernel modules are (re)imported and kept until the end.
Triton is a dev dependency on Linux, so there (and wherever ``CI`` is set) a
missing Triton fails these tests instead of skipping them.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from factory.kernels import cast_dispatch, fp8, hadamard, nvfp4
from factory.precision.quantizers import FP8Quantizer, MXFP8Quantizer, NVFP4Quantizer
from factory.schemas.precision import FP8Options, NVFP4Options

MUST_RUN = sys.platform == "linux" or bool(os.environ.get("CI"))
"""Where Triton is installed with the dev extras, or CI: these tests may not skip."""

FEW = settings(max_examples=30, derandomize=True, deadline=None)
pytestmark = pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning")
TILES = [(1, 16), (16, 16)]


@pytest.fixture(scope="module")
def kernels() -> Iterator[SimpleNamespace]:
    """The kernel modules, defined under the interpreter (re-imported if defined without it)."""
    if importlib.util.find_spec("triton") is None:
        if MUST_RUN:
            pytest.fail("triton is not installed: pip install -e '.[dev]' (these tests must run)")
        pytest.skip("triton is not installed (a dev dependency on Linux only)")
    before = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"  # read when a kernel is defined and when it runs
    try:
        modules = {}
        for name in ("triton_tiles", "triton_nvfp4", "triton_fp8"):  # helpers first: a
            module = importlib.import_module(f"factory.kernels.{name}")  # reload re-binds them
            modules[name] = importlib.reload(module)
        yield SimpleNamespace(nvfp4=modules["triton_nvfp4"], fp8=modules["triton_fp8"])
    finally:
        if before is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = before


def bits(x: torch.Tensor) -> torch.Tensor:
    """The raw bit patterns: equal bits, not just equal values (-0.0 differs from 0.0)."""
    return x.contiguous().view(torch.int32 if x.dtype == torch.float32 else torch.int16)


def assert_same_bits(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    differ = bits(actual) != bits(expected)
    assert not bool(differ.any()), f"{int(differ.sum())} elements differ: {actual[differ][:5]}"


def wide_range(shape: tuple[int, ...], seed: int, spread: float) -> torch.Tensor:
    """Normal values times ``exp(spread * normal)``, with a zero block, -0.0 and a tiny block."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen) * torch.exp(spread * torch.randn(shape, generator=gen))
    flat = x.view(-1, shape[-1])
    flat[0, :16] = 0.0  # an all-zero block (or part of one)
    flat[0, :1] = -0.0
    if flat.shape[0] > 1:
        flat[1, :16] *= 1e-12  # a block whose E4M3 scale underflows to 0 beside larger ones
    return x


def padded_uniforms(shape: tuple[int, ...], tile: tuple[int, int], seed: int) -> torch.Tensor:
    """What the emulation draws from a generator seeded with ``seed``: [B, rows_pad, cols_pad]."""
    *lead, rows, cols = shape
    batch = int(torch.tensor(lead).prod()) if lead else 1
    padded = (batch, rows + -rows % tile[0], cols + -cols % 16)
    return torch.rand(padded, generator=torch.Generator().manual_seed(seed))


@FEW
@given(
    lead=st.sampled_from([(), (2,)]),
    rows=st.integers(1, 40),
    cols=st.integers(1, 70),
    tile=st.sampled_from(TILES),
    stochastic=st.booleans(),
    spread=st.sampled_from([0.0, 3.0, 12.0]),
    seed=st.integers(0, 2**16),
)
def test_nvfp4_fake_quantize_is_the_emulation_bit_for_bit(
    kernels, lead, rows, cols, tile, stochastic, spread, seed
):
    """Partial tiles (zero-padded), zero and underflowing blocks, wide ranges, RN and SR."""
    x = wide_range((*lead, rows, cols), seed, spread)
    gen = torch.Generator().manual_seed(seed + 1)
    expected = nvfp4.fake_quantize(x, tile, stochastic, gen)
    uniform = padded_uniforms(x.shape, tile, seed + 1) if stochastic else None
    assert_same_bits(kernels.nvfp4.fake_quantize(x, tile, uniform=uniform), expected)


@FEW
@given(
    row_tiles=st.integers(1, 3),
    col_blocks=st.integers(1, 5),
    tile=st.sampled_from(TILES),
    stochastic=st.booleans(),
    spread=st.sampled_from([0.0, 4.0]),
    seed=st.integers(0, 2**16),
)
def test_nvfp4_quantize_packs_the_emulations_codes_and_scales(
    kernels, row_tiles, col_blocks, tile, stochastic, spread, seed
):
    x = wide_range((row_tiles * 16, col_blocks * 16), seed, spread)
    expected = nvfp4.quantize(x, tile, stochastic, torch.Generator().manual_seed(seed))
    uniform = torch.rand(x.shape, generator=torch.Generator().manual_seed(seed))
    got = kernels.nvfp4.quantize(x, tile, uniform=uniform if stochastic else None)
    assert torch.equal(got.data, expected.data)
    assert torch.equal(got.scale.view(torch.uint8), expected.scale.view(torch.uint8))
    assert_same_bits(got.amax, expected.amax)
    assert got.tile == expected.tile


def test_nvfp4_rounds_every_e2m1_midpoint_to_the_even_code(kernels):
    """A block whose amax is 6 has scale 448 and enc 1, so the midpoints reach the rounding."""
    row = torch.tensor([6, 5, 3.5, 2.5, 1.75, 1.25, 0.75, 0.25, -5, -0.25, 0, 4, 3, 2, 1, 0.5])
    got = kernels.nvfp4.quantize(row[None].repeat(2, 1)).codes()[0]
    assert got.tolist() == [7, 6, 6, 4, 4, 2, 2, 0, 14, 8, 0, 6, 5, 4, 2, 1]
    assert torch.equal(got, nvfp4.quantize(row[None].repeat(2, 1)).codes()[0])


def test_nvfp4_fake_quantize_rounds_midpoints_and_their_neighbours_as_the_emulation(kernels):
    """The fake-quant kernel rounds to nearest with FP8's bit rounding, the emulation by
    comparisons: every E2M1 midpoint, the fp32 values either side of it and the grid (enc
    is 1: the amax of the tensor and of each block is 6), and the clamp at 6 (blocks whose
    E4M3 scale rounds down scale their amax above 6: six of these sixteen do)."""
    grid = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6])
    points = torch.cat([grid, (grid[1:] + grid[:-1]) / 2])
    up, down = torch.nextafter(points, points + 1), torch.nextafter(points, points - 1)
    values = torch.cat([points, up.clamp(max=6), down.clamp(min=0)])
    x = torch.cat([values, -values])
    x = torch.cat([x, x.new_zeros(-x.numel() % 16)]).reshape(-1, 16)
    x[:, 0] = 6.0
    clamped = torch.linspace(5.5, 6.5, 16)[:, None].repeat(1, 16)
    for matrix in (x, clamped):
        assert_same_bits(kernels.nvfp4.fake_quantize(matrix), nvfp4.fake_quantize(matrix))


def test_the_block_scale_is_one_folded_multiply(kernels):
    """TE computes ``block_amax * (S_enc * (1/6))``, one rounding. With a global amax of 6
    these block amaxes get other E4M3 scales from either two-rounding order."""
    blocks = torch.tensor(
        [6.0, 3.923688200302422e-05, 9.155272709904239e-05, 0.00011771066056098789]
    )
    x = torch.zeros(4, 16)
    x[:, 5] = blocks
    s_enc, sixth = nvfp4.global_encode_scale(torch.tensor(6.0)), torch.tensor(1 / 6)
    expected = nvfp4.quantize(x).scale.view(torch.uint8).reshape(-1)
    for twice in ((blocks * s_enc) * sixth, (blocks / 6) * s_enc):
        assert not bool((twice.to(torch.float8_e4m3fn).view(torch.uint8) == expected)[1:].any())
    got = kernels.nvfp4.quantize(x).scale.view(torch.uint8).reshape(-1)
    assert torch.equal(got, expected)


class _Numbers:
    """A whole tensor whose stochastic-rounding numbers are the given ones."""

    def __init__(self, numbers: torch.Tensor) -> None:
        self.numbers = numbers

    def max(self, local: torch.Tensor) -> torch.Tensor:
        return local

    def sum(self, local: torch.Tensor) -> torch.Tensor:
        return local

    def uniform(
        self, shape: torch.Size, generator: torch.Generator | None, device: torch.device
    ) -> torch.Tensor:
        return self.numbers.reshape(shape).to(device)


def test_stochastic_rounding_goes_up_only_below_the_fraction(kernels):
    """Uniforms equal to a value's distance above the grid point (in steps) round down, as
    ``u < fraction`` does; just below they round up."""
    values = torch.tensor([6.0, 0.75, 2.5, 5.0, 0.375, 1.25, 3.25, 4.5])  # enc is 1 (amax 6)
    fractions = torch.tensor([0.0, 0.5, 0.5, 0.5, 0.75, 0.5, 0.25, 0.25])
    x = torch.cat([values, -values])[None].repeat(2, 1)
    u = torch.cat([fractions, fractions])[None].repeat(2, 1)
    u[1] = torch.nextafter(u[1], torch.tensor(-1.0)).clamp(min=0.0)
    expected = nvfp4.fake_quantize(x, stochastic=True, part=_Numbers(u))
    assert not torch.equal(expected[0], expected[1])  # the ties and their neighbours differ
    assert_same_bits(kernels.nvfp4.fake_quantize(x, uniform=u[None]), expected)


class _GivenAmax:
    """A part of a bigger tensor whose amax is ``whole`` (what an all-reduce would give)."""

    def __init__(self, whole: torch.Tensor) -> None:
        self.whole = whole

    def max(self, local: torch.Tensor) -> torch.Tensor:
        return torch.maximum(local, self.whole)

    def sum(self, local: torch.Tensor) -> torch.Tensor:
        return local

    def uniform(
        self, shape: torch.Size, generator: torch.Generator | None, device: torch.device
    ) -> torch.Tensor:
        return torch.rand(shape, generator=generator, device=device)


@pytest.mark.parametrize("tile", TILES)
def test_a_given_amax_sets_the_global_scale_as_a_split_tensors_would(kernels, tile):
    x = wide_range((2, 20, 48), 3, 2.0)
    whole = torch.tensor([1e4, 3e3])
    expected = nvfp4.fake_quantize(x, tile, part=_GivenAmax(whole))
    assert_same_bits(kernels.nvfp4.fake_quantize(x, tile, amax=whole), expected)
    assert_same_bits(kernels.nvfp4.global_amax(x, tile), x.abs().amax(dim=(1, 2)))


def sequential_rht(x: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """The kernel's rotation order, in torch: ``sum_k x_k * m[k, :]`` for k = 0..15 in turn."""
    m = signs[:, None] * hadamard.hadamard_matrix(16)
    runs = x.to(torch.float32).reshape(*x.shape[:-1], -1, 16)
    acc = runs[..., 0:1] * m[0]
    for k in range(1, 16):
        acc = acc + runs[..., k : k + 1] * m[k]
    return acc.reshape(x.shape).to(x.dtype)


@pytest.mark.parametrize("stochastic", [False, True])
def test_nvfp4_with_the_hadamard_rotation(kernels, stochastic):
    signs = hadamard.random_signs(16, seed=4)
    x = wide_range((24, 40), 5, 2.0)
    padded = torch.nn.functional.pad(x, (0, 8))  # the kernel pads the 3rd run with zeros
    gen = torch.Generator().manual_seed(9)
    expected = nvfp4.fake_quantize(sequential_rht(padded, signs), (1, 16), stochastic, gen)
    uniform = padded_uniforms(x.shape, (1, 16), 9) if stochastic else None
    got = kernels.nvfp4.fake_quantize(x, uniform=uniform, rht_signs=signs)
    assert_same_bits(got, expected[:, :40])
    # Small integers times powers of two: the 16-term sums are exact in any order, so the
    # kernel also equals hadamard.rht's matrix product, BF16 rounding of the rotation included.
    gen = torch.Generator().manual_seed(1)
    ints = torch.randint(-64, 64, (32, 48), generator=gen) * 2.0 ** torch.randint(-3, 3, (32, 1))
    xb = ints.to(torch.bfloat16)
    expected = nvfp4.fake_quantize(hadamard.rht(xb, signs), (16, 16))
    assert_same_bits(kernels.nvfp4.fake_quantize(xb, (16, 16), rht_signs=signs), expected)
    packed = kernels.nvfp4.quantize(xb, (16, 16), rht_signs=signs)
    assert torch.equal(packed.data, nvfp4.quantize(hadamard.rht(xb, signs), (16, 16)).data)


def test_nvfp4_writes_bf16_as_torch_rounds_the_fp32_result(kernels):
    x = wide_range((40, 64), 6, 3.0).to(torch.bfloat16)
    expected = nvfp4.fake_quantize(x).to(torch.bfloat16)
    assert_same_bits(kernels.nvfp4.fake_quantize(x, out_dtype=torch.bfloat16), expected)


@pytest.mark.parametrize("scale", [1e-40, 1e-30, 1e30, 1e38])
def test_extreme_magnitudes(kernels, scale):
    """Subnormal inputs, subnormal E4M3 block scales, and amaxes near the fp32 limit."""
    x = torch.randn(32, 48, generator=torch.Generator().manual_seed(2)).clamp(-3, 3) * scale
    for tile in TILES:
        assert_same_bits(kernels.nvfp4.fake_quantize(x, tile), nvfp4.fake_quantize(x, tile))
    for fmt in ("e4m3", "e5m2"):
        expected = fp8.quantize_tensorwise(x, fmt).dequantize()
        assert_same_bits(kernels.fp8.fake_quantize_tensorwise(x, fmt), expected)
        expected = fp8.quantize_mxfp8(x, fmt).dequantize()
        assert_same_bits(kernels.fp8.fake_quantize_mxfp8(x, fmt), expected)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_input_is_refused(kernels, bad):
    x = torch.randn(20, 40)
    x[7, 33] = bad
    calls = [
        lambda: kernels.nvfp4.fake_quantize(x),
        lambda: kernels.nvfp4.fake_quantize(x, rht_signs=hadamard.random_signs(16)),
        lambda: kernels.nvfp4.quantize(x[:16, :32].clone().fill_(bad)),
        lambda: kernels.fp8.fake_quantize_tensorwise(x),
        lambda: kernels.fp8.fake_quantize_mxfp8(x),
    ]
    for call in calls:
        with pytest.raises(ValueError, match=r"non-finite|inf or NaN"):
            call()


def test_shapes_and_arguments_the_kernels_refuse(kernels):
    with pytest.raises(ValueError, match="whole tiles"):
        kernels.nvfp4.quantize(torch.randn(8, 24), (1, 16))
    with pytest.raises(ValueError, match="padded shape"):
        kernels.nvfp4.fake_quantize(torch.randn(8, 24), uniform=torch.rand(8, 24))
    with pytest.raises(ValueError, match="tile"):
        kernels.nvfp4.fake_quantize(torch.randn(8, 32), (16, 1))
    with pytest.raises(ValueError, match="fmt"):
        kernels.fp8.fake_quantize_mxfp8(torch.randn(8, 32), "e3m4")


@FEW
@given(
    shape=st.sampled_from([(1, 1), (5, 33), (2, 17, 70), (40, 96)]),
    fmt=st.sampled_from(["e4m3", "e5m2"]),
    spread=st.sampled_from([0.0, 3.0, 10.0]),
    seed=st.integers(0, 2**16),
)
def test_fp8_kernels_are_the_emulation_bit_for_bit(kernels, shape, fmt, spread, seed):
    """Current scaling per matrix and MXFP8 with tail blocks, zero blocks and wide ranges."""
    x = wide_range(shape, seed, spread)
    matrices = x.reshape(-1, *shape[-2:])
    expected = torch.stack([fp8.quantize_tensorwise(m, fmt).dequantize() for m in matrices])
    assert_same_bits(kernels.fp8.fake_quantize_tensorwise(x, fmt), expected.reshape(shape))
    expected = fp8.quantize_mxfp8(x, fmt).dequantize()
    assert_same_bits(kernels.fp8.fake_quantize_mxfp8(x, fmt), expected)
    assert_same_bits(kernels.fp8.fake_quantize_mxfp8(x.transpose(-1, -2), fmt),
                     fp8.quantize_mxfp8(x.transpose(-1, -2), fmt).dequantize())  # fmt: skip


def test_fp8_current_scaling_is_transformer_engines_order(kernels):
    """``fp8(x * scale)`` dequantized by ``scale_inv = 1 / scale`` with ``scale = FP8_MAX /
    amax``: on these tensors the old order (``x / s``, ``s = amax / FP8_MAX``) gives other
    values, and the kernel follows TE's."""
    checked = 0
    for seed in range(12):
        x = torch.randn(1, 256, generator=torch.Generator().manual_seed(seed))
        s = x.abs().max() / 448.0
        old = (x / s).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s
        expected = fp8.quantize_tensorwise(x, "e4m3").dequantize()
        if torch.equal(old, expected):
            continue
        assert_same_bits(kernels.fp8.fake_quantize_tensorwise(x, "e4m3"), expected)
        checked += 1
    assert checked >= 2


def test_the_quantizers_cast_alike_through_the_kernels(kernels, monkeypatch):
    """The dispatch's kernel path (forced for CPU tensors) gives the emulation's operands, and
    draws the same stochastic-rounding numbers from the quantizer's generator."""
    gen = torch.Generator().manual_seed(0)
    # Integer-valued inputs make the rotation exact, so wgrad compares bit for bit too.
    x = torch.randint(-40, 40, (2, 24, 48), generator=gen).float()
    dy = torch.randint(-40, 40, (2, 24, 32), generator=gen).float() * 2.0**-10
    w = torch.randn(32, 48, generator=gen)

    def operands(quantizer) -> list[torch.Tensor]:
        return [
            quantizer.input(x),
            quantizer.weight(w),
            quantizer.grad(dy),
            *quantizer.wgrad(dy, x),
        ]

    recipes = [
        lambda: NVFP4Quantizer(NVFP4Options(), seed=3),
        lambda: NVFP4Quantizer(NVFP4Options(weight_tile="1x16", hadamard=False), seed=3),
        lambda: FP8Quantizer(FP8Options(scaling="tensorwise", format="hybrid")),
        lambda: MXFP8Quantizer(),
    ]
    for make in recipes:
        emulated = operands(make())
        with monkeypatch.context() as patch:
            patch.setattr(cast_dispatch, "triton_kernels", lambda t: (kernels.nvfp4, kernels.fp8))
            via_kernels = operands(make())
        for got, expected in zip(via_kernels, emulated, strict=True):
            assert_same_bits(got, expected)


def test_compiled_for_hopper_every_fp32_operation_is_ieee(kernels):
    """Compiled for sm_90 (no GPU needed), the kernels' fp32 arithmetic is what the interpreter
    computes: no FMA contraction, no flush-to-zero, no approximate division, no float
    negation."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    driver = Path(__file__).with_name("triton_ptx_driver.py")
    done = subprocess.run(
        [sys.executable, str(driver)], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-2000:]
    variants = json.loads(done.stdout)
    assert len(variants) == 6
    for name, ops in variants.items():
        arithmetic = [op for op in ops if op.split(".")[0] in ("add", "sub", "mul", "div", "fma")]
        assert {"mul.rn.f32", "add.rn.f32"} & set(arithmetic), name
        assert all(op.split(".")[:2] in (["add", "rn"], ["sub", "rn"], ["mul", "rn"],
                                         ["div", "rn"]) for op in arithmetic), (name, arithmetic)  # fmt: skip
        # A compiled negation gave +0.0 for -0.0 on an H100: signs are set by bits instead.
        assert not {"neg.f32", "sub-from-zero"} & set(ops), (name, ops)
        assert not [op for op in ops if "ftz" in op or "approx" in op], (name, ops)


def test_factory_and_the_cpu_path_never_import_triton():
    code = (
        "import sys, torch, factory\n"
        "from factory.kernels import cast_dispatch\n"
        "cast_dispatch.nvfp4_fake_quantize(torch.randn(4, 16), stochastic=True)\n"
        "cast_dispatch.mxfp8(torch.randn(4, 32))\n"
        "assert 'triton' not in sys.modules, 'triton was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_these_tests_run_where_they_must(kernels):
    """Where the dev extras install Triton (Linux) or in CI, the fixture fails rather than
    skips; here it ran, so the kernels above ran under the interpreter, not compiled."""
    from triton.runtime.interpreter import InterpretedFunction

    assert isinstance(kernels.nvfp4._fake_kernel, InterpretedFunction)
    assert isinstance(kernels.fp8._mxfp8_kernel, InterpretedFunction)
    if MUST_RUN:
        assert importlib.util.find_spec("triton") is not None
