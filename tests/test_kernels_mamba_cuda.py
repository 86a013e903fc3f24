"""The Mamba mixer's kernels on a CUDA device against its PyTorch paths on the same device
(``python -m benchmarks gpu`` runs these; without CUDA they skip).

Tolerances are relative to the largest magnitude of the reference tensor. fp32: Triton's
``tl.dot`` rounds its fp32 inputs to TF32 on Ampere and newer (mamba_ssm's scan), so about
1e-3 for the scan; the conv has no dot and agrees to fp32 rounding. bf16: both paths round
their bf16 intermediates at different places (the reference after each op, the kernels
once), so about 1e-2.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from factory.kernels import causal_conv, gated_norm, mamba_ssm_triton, ssd
from factory.layers.mamba.module import Mamba2Mixer, _causal_depthwise_conv, kernel_choices
from factory.nn.norms import GatedGroupRMSNorm
from factory.schemas.model import MambaConfig

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@contextlib.contextmanager
def reference_paths() -> Iterator[None]:
    """Every Mamba kernel dispatch on its PyTorch path, CUDA tensors included."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(mamba_ssm_triton, "DEVICE_TYPES", set())
        yield


def assert_close_to(actual: torch.Tensor, expected: torch.Tensor, rel: float) -> None:
    scale = expected.abs().max().item() + 1e-6
    torch.testing.assert_close(actual.float(), expected.float(), rtol=0, atol=rel * scale)


def documents(b: int, length: int, seed: int) -> torch.Tensor:
    """Rows cut into documents at random positions (the first row also at the very start)."""
    gen = torch.Generator().manual_seed(seed)
    starts = (torch.rand(b, length, generator=gen) < 0.01).long()
    starts[0, 1] = 1
    return starts.cumsum(1).cuda()


def mixer(dtype: torch.dtype) -> Mamba2Mixer:
    cfg = MambaConfig(heads=8, head_dim=64, state_size=128, groups=2, chunk_size=128)
    torch.manual_seed(0)
    module = Mamba2Mixer(256, cfg, 1e-5)
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.copy_(torch.randn_like(parameter) * 0.05)
        module.A_log.copy_(torch.log(torch.arange(1, 9.0)))
        module.dt_bias.fill_(-3.0)
    return module.cuda().to(dtype)


def test_the_device_takes_the_field_kernels() -> None:
    choices = kernel_choices(SimpleNamespace(mamba=mixer(torch.float32).cfg), "cuda")
    assert [c.kernel for c in choices] == [causal_conv.TRITON, ssd.TRITON, gated_norm.TRITON], [
        c.describe() for c in choices
    ]


@pytest.mark.parametrize(("dtype", "rel"), [(torch.float32, 5e-3), (torch.bfloat16, 3e-2)])
def test_mixer_kernels_equal_the_pytorch_paths(dtype: torch.dtype, rel: float) -> None:
    """The whole mixer with packed documents: output and gradients, kernels against reference."""
    module = mixer(dtype)
    x = torch.randn(2, 1024, 256, generator=torch.Generator().manual_seed(1)).cuda().to(dtype)
    document_ids = documents(2, 1024, seed=2)
    results = []
    for paths in (contextlib.nullcontext, reference_paths):
        module.zero_grad()
        leaf = x.clone().requires_grad_()
        with paths():
            out = module(leaf, document_ids)
            out.float().square().sum().backward()
        results.append([out, leaf.grad, *(p.grad for p in module.parameters())])
    for ours, reference in zip(*results, strict=True):
        assert_close_to(ours, reference, rel)


def _conv_results(
    inputs: list[torch.Tensor], document_ids: torch.Tensor, paths: Callable[[], Any]
) -> list[torch.Tensor]:
    """The conv's output and its three gradients, in float64, on the dispatch ``paths`` set."""
    leaves = [t.clone().requires_grad_() for t in inputs]
    with paths():
        out = _causal_depthwise_conv(*leaves, document_ids)
    out.float().sin().sum().backward()
    return [t.double() for t in (out, *(leaf.grad for leaf in leaves))]


@pytest.mark.parametrize(("dtype", "rel"), [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_conv_kernel_equals_the_reference(dtype: torch.dtype, rel: float) -> None:
    # Both are measured against float64 on the same rounded inputs: in bf16 the PyTorch path
    # rounds after every tap and is itself ~3% of the largest input gradient off (the H200
    # run of 2026-11-28 failed a direct comparison of the two by that much).
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 1000, 700, generator=gen)[..., :640].cuda().to(dtype)
    weight = torch.randn(640, 1, 4, generator=gen).cuda().to(dtype)
    bias = torch.randn(640, generator=gen).cuda().to(dtype)
    document_ids = documents(2, 1000, seed=4)
    ours = _conv_results([x, weight, bias], document_ids, contextlib.nullcontext)
    reference = _conv_results([x, weight, bias], document_ids, reference_paths)
    exact = _conv_results([t.double() for t in (x, weight, bias)], document_ids, reference_paths)
    for name, mine, theirs, truth in zip(
        ("out", "dx", "dw", "db"), ours, reference, exact, strict=True
    ):
        scale = truth.abs().max().item()
        error, reference_error = ((t - truth).abs().max().item() for t in (mine, theirs))
        assert error <= max(reference_error, rel * scale), (name, error, reference_error, scale)


def test_gated_norm_kernel_equals_the_module_in_bf16() -> None:
    norm = GatedGroupRMSNorm(512, 4, 1e-5).cuda()
    gen = torch.Generator().manual_seed(5)
    y, z = (torch.randn(4, 300, 512, generator=gen).cuda().bfloat16() for _ in range(2))
    ours = norm(y, z)
    with reference_paths():
        reference = norm(y, z)
    assert ours.dtype == torch.bfloat16
    assert_close_to(ours, reference, 1e-2)


def test_compiled_mixer_runs_the_kernels_and_equals_eager() -> None:
    """torch.compile with the kernels outside its graph (a graph break each): same values."""
    module = mixer(torch.float32)
    x = torch.randn(2, 512, 256, generator=torch.Generator().manual_seed(6)).cuda()
    document_ids = documents(2, 512, seed=7)
    eager = module(x, document_ids)
    compiled = torch.compile(module)(x, document_ids)
    assert_close_to(compiled, eager, 1e-4)
