"""``nvfp4.fake_quantize``: the emulated GEMMs' operand values (``docs/precision.md``).

``fake_quantize`` must give, bit for bit, what ``quantize(...).dequantize()`` gives
(the TE-exact reference), for both tiles and both rounding modes (SR draws the
same random numbers from an identically seeded generator), plus two extensions:
leading batch dims (one global amax per matrix) and zero padding of shapes that
are not whole tiles (then cropping).

The one deliberate exception to "bit for bit" is the sign of an exact ``-0.0``
input: ``quantize`` gives it code 0 (+0.0, TE's first test is ``x >= 0``) while
``fake_quantize`` copies the sign (-0.0). Both are zero; :func:`assert_same_bits`
compares zeros by value and every other element by its bit pattern.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from factory.kernels.nvfp4 import fake_quantize, quantize

TILES = [(1, 16), (16, 16)]


def assert_same_bits(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal fp32 bit patterns, except that +0.0 and -0.0 count as the same zero."""
    assert actual.dtype == expected.dtype == torch.float32
    assert actual.shape == expected.shape
    zero = expected == 0
    assert torch.equal(actual == 0, zero), "zeros in different places"
    bits_a = actual.view(torch.int32)[~zero]
    bits_e = expected.view(torch.int32)[~zero]
    mismatch = (bits_a != bits_e).nonzero()
    assert mismatch.numel() == 0, f"{mismatch.shape[0]} elements differ in their bits"


def reference(
    x: torch.Tensor, tile: tuple[int, int], stochastic: bool, gen: torch.Generator | None
) -> torch.Tensor:
    """``quantize(...).dequantize()`` of the zero-padded matrix, cropped back to x's shape."""
    rows, cols = x.shape
    padded = F.pad(x, (0, -cols % 16, 0, -rows % tile[0]))
    out = quantize(padded, tile, stochastic=stochastic, generator=gen).dequantize()
    return out[:rows, :cols]


def wide_range_matrix(
    seed: int, shape: tuple[int, ...], log2_scale: int, spread: int, zero_block: bool
) -> torch.Tensor:
    """Gaussian values times ``2**log2_scale``, each element further scaled by
    ``2**U{-spread..spread}`` (a wide dynamic range inside one tensor, so that
    block scales underflow E4M3 next to blocks at the global amax)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen, dtype=torch.float64)
    if spread:
        x = x * torch.exp2(torch.randint(-spread, spread + 1, shape, generator=gen).double())
    x = (x * 2.0**log2_scale).float()
    if zero_block and shape[-1] >= 16:
        x[..., 0, :16] = 0.0  # an all-zero block (scale byte 0x00)
    return x


# --- equality with quantize().dequantize() -----------------------------------------------


@pytest.mark.parametrize("tile", TILES)
@pytest.mark.parametrize("stochastic", [False, True])
@settings(deadline=None, max_examples=25, derandomize=True)
@given(
    row_tiles=st.integers(1, 3),
    col_blocks=st.integers(1, 4),
    log2_scale=st.integers(-60, 60),
    spread=st.sampled_from([0, 6, 20]),
    zero_block=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_fake_quantize_equals_quantize_dequantize(
    tile: tuple[int, int],
    stochastic: bool,
    row_tiles: int,
    col_blocks: int,
    log2_scale: int,
    spread: int,
    zero_block: bool,
    seed: int,
) -> None:
    rows = row_tiles * (16 if tile[0] == 16 else 5)
    x = wide_range_matrix(seed, (rows, 16 * col_blocks), log2_scale, spread, zero_block)
    gen_a = torch.Generator().manual_seed(seed + 1) if stochastic else None
    gen_b = torch.Generator().manual_seed(seed + 1) if stochastic else None
    expected = quantize(x, tile, stochastic=stochastic, generator=gen_a).dequantize()
    actual = fake_quantize(x, tile, stochastic=stochastic, generator=gen_b)
    assert_same_bits(actual, expected)
    if stochastic:  # both consumed the same random numbers
        assert torch.equal(gen_a.get_state(), gen_b.get_state())


@pytest.mark.parametrize("tile", TILES)
@pytest.mark.parametrize(
    "x",
    [
        torch.zeros(16, 32),  # amax 0: S_enc = 1, everything decodes to 0
        torch.full((16, 16), 1e-42),  # subnormal amax: S_enc saturates at FLT_MAX
        torch.full((16, 16), 3e38).index_fill_(1, torch.tensor([3]), -1e30),  # near FLT_MAX
        torch.tensor([[-0.01] + [1.0] * 15] * 16),  # a negative value rounding to -0
        torch.linspace(-6.0, 6.0, 16 * 32).reshape(16, 32),  # the grid's ties included
    ],
    ids=["zeros", "subnormal", "huge", "negative-to-zero", "ties"],
)
def test_fake_quantize_edge_values(tile: tuple[int, int], x: torch.Tensor) -> None:
    for stochastic in (False, True):
        gen_a, gen_b = (torch.Generator().manual_seed(5) for _ in range(2))
        expected = quantize(x, tile, stochastic=stochastic, generator=gen_a).dequantize()
        assert_same_bits(fake_quantize(x, tile, stochastic=stochastic, generator=gen_b), expected)


def test_fake_quantize_negative_to_zero_keeps_the_sign_like_code_8() -> None:
    """A negative value that rounds to zero is code 8 (-0.0) in ``quantize``: same bits here."""
    x = torch.tensor([[-0.01] + [1.0] * 15])
    expected = quantize(x).dequantize()
    actual = fake_quantize(x)
    assert torch.signbit(expected[0, 0]) and torch.signbit(actual[0, 0])


def test_fake_quantize_exact_negative_zero_is_zero() -> None:
    """An exact -0.0 input is +0.0 in ``quantize`` (code 0) and -0.0 here: equal as values."""
    x = torch.tensor([[-0.0] + [1.0] * 15])
    assert fake_quantize(x)[0, 0] == 0 == quantize(x).dequantize()[0, 0]


def test_fake_quantize_output_dtype_shape_and_no_grad() -> None:
    x = torch.randn(3, 32, 48, dtype=torch.bfloat16, requires_grad=True)
    out = fake_quantize(x, (16, 16))
    assert out.dtype == torch.float32 and out.shape == x.shape and not out.requires_grad
    assert torch.equal(out, fake_quantize(x.detach().float(), (16, 16)))


# --- batched input -------------------------------------------------------------------


@pytest.mark.parametrize("tile", TILES)
@pytest.mark.parametrize("stochastic", [False, True])
@pytest.mark.parametrize("shape", [(2, 3, 16, 48), (4, 32, 16), (3, 20, 40)])
def test_batched_equals_per_matrix(
    tile: tuple[int, int], stochastic: bool, shape: tuple[int, ...]
) -> None:
    """Every matrix of ``[..., rows, cols]`` has its own amax; SR draws the random numbers
    of the matrices one after the other (so a per-matrix loop sharing one generator
    replays them), also when the matrices are padded."""
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(shape, generator=gen)
    # Very different magnitudes per matrix: a shared amax would flush the small ones.
    x = x * torch.logspace(-8, 8, x[..., 0, 0].numel(), base=2.0).reshape(*shape[:-2], 1, 1)
    gen_a = torch.Generator().manual_seed(3) if stochastic else None
    gen_b = torch.Generator().manual_seed(3) if stochastic else None
    actual = fake_quantize(x, tile, stochastic=stochastic, generator=gen_a)
    flat = x.reshape(-1, *shape[-2:])
    expected = torch.stack([reference(m, tile, stochastic, gen_b) for m in flat])
    assert_same_bits(actual, expected.reshape(shape))


def test_batched_amax_is_per_matrix_not_global() -> None:
    small, big = torch.randn(16, 32), 1e6 * torch.randn(16, 32)
    out = fake_quantize(torch.stack([small, big]))
    assert torch.equal(out[0], fake_quantize(small))
    assert not torch.equal(out[0], fake_quantize(torch.cat([small, big]))[:16])


def test_empty_batch_dim() -> None:
    assert fake_quantize(torch.zeros(0, 16, 16)).shape == (0, 16, 16)


# --- padding of partial tiles --------------------------------------------------------------


@pytest.mark.parametrize("tile", TILES)
@pytest.mark.parametrize("stochastic", [False, True])
@settings(deadline=None, max_examples=25, derandomize=True)
@given(
    rows=st.integers(1, 40),
    cols=st.integers(1, 70),
    log2_scale=st.integers(-30, 30),
    spread=st.sampled_from([0, 10]),
    seed=st.integers(0, 2**31 - 1),
)
def test_padding_equals_quantizing_the_zero_padded_matrix(
    tile: tuple[int, int],
    stochastic: bool,
    rows: int,
    cols: int,
    log2_scale: int,
    spread: int,
    seed: int,
) -> None:
    x = wide_range_matrix(seed, (rows, cols), log2_scale, spread, zero_block=False)
    gen_a = torch.Generator().manual_seed(seed) if stochastic else None
    gen_b = torch.Generator().manual_seed(seed) if stochastic else None
    actual = fake_quantize(x, tile, stochastic=stochastic, generator=gen_a)
    assert actual.shape == (rows, cols)
    assert_same_bits(actual, reference(x, tile, stochastic, gen_b))


@settings(deadline=None, max_examples=25, derandomize=True)
@given(rows=st.integers(1, 40), cols=st.integers(1, 40), seed=st.integers(0, 2**31 - 1))
def test_16x16_tiles_quantize_w_and_w_transposed_alike(rows: int, cols: int, seed: int) -> None:
    """``docs/precision.md``, 'NVFP4 tiles': 16x16 tiles are their own transpose, so W and Wᵀ
    give the same values (what lets dgrad reuse fprop's weight), partial tiles included."""
    w = wide_range_matrix(seed, (rows, cols), 0, 4, zero_block=False)
    assert_same_bits(fake_quantize(w.T, (16, 16)).T, fake_quantize(w, (16, 16)))


def test_1x16_tiles_are_not_transpose_symmetric() -> None:
    w = torch.randn(32, 32, generator=torch.Generator().manual_seed(0))
    assert not torch.equal(fake_quantize(w.T, (1, 16)).T, fake_quantize(w, (1, 16)))


def test_padding_leaves_whole_tiles_of_a_fixed_amax_alone() -> None:
    """With the global amax in the complete part, the complete tiles of a padded matrix
    quantize exactly as the cropped matrix does: the zero padding changes nothing."""
    x = torch.randn(20, 40, generator=torch.Generator().manual_seed(1))
    x[0, 0] = 100.0  # the amax, inside the first whole 16x32 part
    for tile in TILES:
        assert_same_bits(fake_quantize(x, tile)[:16, :32], fake_quantize(x[:16, :32], tile))


# --- errors -----------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("shape", [(16, 16), (2, 5, 20)])
def test_non_finite_input_is_rejected(bad: float, shape: tuple[int, ...]) -> None:
    x = torch.randn(shape)
    x.view(-1)[7] = bad
    with pytest.raises(ValueError, match="non-finite"):
        fake_quantize(x)
    with pytest.raises(ValueError, match="non-finite"):
        fake_quantize(x, (16, 16), stochastic=True)


@pytest.mark.parametrize("shape", [(), (16,), (40,)])
def test_fewer_than_two_dims_is_rejected(shape: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match=r"\[\.\.\., rows, cols\]"):
        fake_quantize(torch.ones(shape))


@pytest.mark.parametrize("tile", [(1, 32), (16, 1), (2, 16)])
def test_unsupported_tile_is_rejected(tile: tuple[int, int]) -> None:
    with pytest.raises(ValueError, match="tile"):
        fake_quantize(torch.ones(16, 16), tile)


@pytest.mark.parametrize("shape", [(0, 16), (16, 0), (3, 0, 5)])
def test_empty_operands_give_empty_results(shape: tuple[int, ...]) -> None:
    """An expert that got no tokens has an empty operand."""
    out = fake_quantize(torch.zeros(shape))
    assert out.shape == shape and out.dtype == torch.float32
    if shape[-1] % 16 == 0:
        assert quantize(torch.zeros(shape)).dequantize().shape == shape
