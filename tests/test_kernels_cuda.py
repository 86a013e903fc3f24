"""The casts on a CUDA device: stochastic-rounding numbers drawn there, and the compiled Triton
kernels against the PyTorch emulation on the same device (``python -m benchmarks gpu``
runs these; without CUDA they skip)."""

from __future__ import annotations

import pytest
import torch

from factory.kernels import cast_dispatch, nvfp4
from factory.kernels.tensor_parts import WHOLE, draw_uniform

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_device_draws_follow_the_quantizers_generator() -> None:
    """The same generator state gives the same numbers on the device, and each call moves the
    generator on by one draw, so a checkpointed state resumes the same rounding."""
    cuda = torch.device("cuda")
    first, second = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    a = draw_uniform([64, 256], first, cuda)
    assert a.device.type == "cuda" and a.dtype == torch.float32
    assert torch.equal(a, draw_uniform([64, 256], second, cuda))
    assert not torch.equal(draw_uniform([64, 256], first, cuda), a)
    assert bool(((a >= 0) & (a < 1)).all())


@pytest.mark.parametrize("tile", [(1, 16), (16, 16)])
@pytest.mark.parametrize("stochastic", [False, True])
def test_kernels_round_as_the_emulation_on_the_device(tile: tuple[int, int], stochastic: bool):
    """The Triton path (chosen for CUDA tensors) and the emulation, both on the device with the
    same generator state: the same bits, round-to-nearest and stochastic."""
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(96, 160, generator=gen) * 3).cuda()
    seeds = [torch.Generator().manual_seed(1) for _ in range(2)]
    ours = cast_dispatch.nvfp4_fake_quantize(x, tile, stochastic, seeds[0], WHOLE)
    emulated = nvfp4.fake_quantize(x, tile, stochastic, seeds[1], WHOLE)
    differ = ours.view(torch.int32) != emulated.view(torch.int32)
    assert not bool(differ.any()), (
        f"{int(differ.sum())} of {differ.numel()} differ: x {x[differ][:4].tolist()}, "
        f"kernel {ours[differ][:4].tolist()}, emulation {emulated[differ][:4].tolist()}"
    )
