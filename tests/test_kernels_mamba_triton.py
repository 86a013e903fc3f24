"""The Mamba mixer's Triton kernels against its PyTorch paths, on CPU under Triton's interpreter.

mamba_ssm's SSD scan and gated RMSNorm (its build without the CUDA extension, loaded by
``factory.kernels.mamba_ssm_triton``) and our causal conv run here on tiny shapes with
``TRITON_INTERPRET=1``; the ``field_kernels`` fixture lets the dispatches send CPU tensors to
them (``DEVICE_TYPES``), gives mamba_ssm's wrappers the two CUDA queries they make on the way
(the device context and the SM count), and keeps one autotune config per kernel, so the
interpreter runs each kernel once instead of once per config. Everything is restored after.

Without mamba_ssm (or Triton) the kernel tests skip, except under CI, whose test command
installs both: there a missing one fails. The dispatch tests at the end run everywhere.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from factory.kernels import causal_conv, gated_norm, mamba_ssm_triton, ssd
from factory.kernels.choice import KernelChoice
from factory.kernels.ssd import ScanInputs, ssd_chunked_scan, ssd_chunked_scan_torch
from factory.layers.mamba.module import Mamba2Mixer, _causal_depthwise_conv, kernel_choices
from factory.nn.norms import GatedGroupRMSNorm
from factory.schemas.model import MambaConfig

MUST_RUN = bool(os.environ.get("CI"))
"""CI installs mamba_ssm (README's test command): there these tests may not skip."""


def _forget_loaded_kernels() -> None:
    """Drop the cached loads and mamba_ssm's modules, so the next load defines them anew."""
    for name in [n for n in sys.modules if n == "mamba_ssm" or n.startswith("mamba_ssm.")]:
        del sys.modules[name]
    sys.modules.pop("factory.kernels.triton_causal_conv", None)
    for cached in (mamba_ssm_triton._load, ssd._kernel, gated_norm._kernel, causal_conv._load):
        cached.cache_clear()


def _cpu_device(index: int | None) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext() if index is None else real_cuda_device(index)


real_cuda_device = torch.cuda.device


@pytest.fixture
def field_kernels() -> Iterator[None]:
    for package in ("triton", "mamba_ssm"):
        if importlib.util.find_spec(package) is None:
            message = f"{package} is not installed (README, 'GPU kernels')"
            if MUST_RUN:
                pytest.fail(message)
            pytest.skip(message)
    import triton

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TRITON_INTERPRET", "1")  # read when a kernel is defined and when it runs
        patch.setattr(mamba_ssm_triton, "DEVICE_TYPES", {"cuda", "cpu"})
        patch.setattr(torch.cuda, "device", _cpu_device)
        patch.setattr(
            torch.cuda,
            "get_device_properties",
            lambda device: SimpleNamespace(multi_processor_count=4),
        )
        _forget_loaded_kernels()
        try:
            for name in (ssd.SSD_MODULE, gated_norm.NORM_MODULE):
                assert mamba_ssm_triton.unavailable(name) is None, mamba_ssm_triton.unavailable(
                    name
                )
            for name, module in list(sys.modules.items()):
                if name.startswith("mamba_ssm."):
                    for tuner in vars(module).values():
                        if isinstance(tuner, triton.runtime.autotuner.Autotuner):
                            patch.setattr(tuner, "configs", tuner.configs[:1])
            yield
        finally:
            _forget_loaded_kernels()


@contextlib.contextmanager
def reference_paths() -> Iterator[None]:
    """The dispatches as on a CPU run: every kernel on its PyTorch path."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(mamba_ssm_triton, "DEVICE_TYPES", {"cuda"})
        yield


def assert_close_to(actual: torch.Tensor, expected: torch.Tensor, rel: float = 1e-5) -> None:
    """Equal within ``rel`` of the expected tensor's largest magnitude (fp32 sums in another
    order: the error scales with the values, not each element)."""
    scale = expected.abs().max().item() + 1e-6
    torch.testing.assert_close(actual, expected, rtol=0, atol=rel * scale)


def documents(*lengths_per_row: list[int]) -> torch.Tensor:
    rows = [
        torch.repeat_interleave(torch.arange(len(ls)), torch.tensor(ls)) for ls in lengths_per_row
    ]
    return torch.stack(rows)


def test_ssd_kernel_equals_the_reference_with_documents_and_initial_state(field_kernels) -> None:
    """mamba_chunk_scan_combined through the dispatch: y, the final state and every gradient equal
    the chunked PyTorch scan's, with three documents in a row, D and an initial state."""
    gen = torch.Generator().manual_seed(0)
    b, length, heads, head_dim, groups, state = 2, 24, 4, 8, 2, 16
    tensors = {
        "x": torch.randn(b, length, heads, head_dim, generator=gen),
        "dt": torch.rand(b, length, heads, generator=gen) * 0.5 + 0.05,
        "A": -torch.rand(heads, generator=gen) - 0.1,
        "B": torch.randn(b, length, groups, state, generator=gen),
        "C": torch.randn(b, length, groups, state, generator=gen),
        "D": torch.randn(heads, generator=gen),
        "initial_state": torch.randn(b, heads, head_dim, state, generator=gen),
    }
    seq_idx = documents([5, 12, 7], [24])
    assert ssd._choose("cpu", torch.float32, 16)[0] is not None  # the dispatch takes the kernel
    results = []
    for scan in (ssd_chunked_scan, ssd_chunked_scan_torch):
        leaves = {k: v.clone().requires_grad_() for k, v in tensors.items()}
        y, final = scan(ScanInputs(**leaves, seq_idx=seq_idx), 16, return_final_state=True)
        (y.sin().sum() + final.cos().sum()).backward()
        results.append([y, final, *(leaves[k].grad for k in tensors)])
    for ours, reference in zip(*results, strict=True):
        assert_close_to(ours.detach(), reference.detach())


def test_gated_norm_kernel_equals_the_module(field_kernels) -> None:
    """rmsnorm_fn with norm_before_gate=False and the module's group size: rmsnorm_group(y *
    silu(z)) * weight, forward and gradients, as GatedGroupRMSNorm's PyTorch path."""
    gen = torch.Generator().manual_seed(1)
    y, z = torch.randn(2, 5, 64, generator=gen), torch.randn(2, 5, 64, generator=gen)
    results = []
    for paths in (contextlib.nullcontext, reference_paths):
        norm = GatedGroupRMSNorm(64, 4, 1e-5)
        with torch.no_grad():
            norm.weight.copy_(torch.randn(64, generator=torch.Generator().manual_seed(2)))
        leaves = [y.clone().requires_grad_(), z.clone().requires_grad_()]
        with paths():
            assert (gated_norm.triton_gated_rmsnorm(y) is None) == (paths is reference_paths)
            out = norm(*leaves)
        out.pow(2).sum().backward()
        results.append([out, leaves[0].grad, leaves[1].grad, norm.weight.grad])
    for ours, reference in zip(*results, strict=True):
        assert_close_to(ours.detach(), reference.detach())


@pytest.mark.parametrize(
    ("with_bias", "k", "with_documents"), [(True, 4, True), (False, 3, True), (True, 4, False)]
)
def test_conv_kernel_equals_the_reference_across_documents(
    field_kernels, with_bias: bool, k: int, with_documents: bool
) -> None:
    """The Triton conv on a strided view (as the in-projection's split leaves it), lengths and
    channels that leave partial tiles, two spans of the backward's weight-gradient sums, and
    documents that start inside the first taps: output and the gradients of x, weight and
    bias, for the usual width 4 and a width that is not a power of two; and rows without
    documents (no seq_idx)."""
    from factory.kernels import triton_causal_conv

    gen = torch.Generator().manual_seed(3)
    b, length, channels = 2, 300, 70
    x = torch.randn(b, length, channels + 9, generator=gen)[..., 9:]
    weight = torch.randn(channels, 1, k, generator=gen)
    bias = torch.randn(channels, generator=gen) if with_bias else None
    seq_idx = documents([2, 1, 150, 147], [300]) if with_documents else None
    upstream = torch.randn(b, length, channels, generator=gen)
    results = []
    for conv in (triton_causal_conv.causal_depthwise_conv, _causal_depthwise_conv):
        leaves = [t.clone().requires_grad_() for t in (x, weight, bias) if t is not None]
        out = conv(leaves[0], leaves[1], leaves[2] if with_bias else None, seq_idx)
        out.backward(upstream)
        results.append([out, *(leaf.grad for leaf in leaves)])
    for ours, reference in zip(*results, strict=True):
        assert_close_to(ours.detach(), reference.detach(), rel=1e-6)


def test_conv_kernel_in_bf16_is_as_close_to_float64_as_the_reference(field_kernels) -> None:
    """In bf16 the kernel accumulates its taps in fp32 and rounds once: against float64 on the
    same rounded inputs it is no further off than the PyTorch path, which rounds after each
    tap (the CUDA test makes the same check at Nano's width: a direct comparison of the two
    failed on an H200 by the reference's own error)."""
    from factory.kernels import triton_causal_conv

    gen = torch.Generator().manual_seed(3)
    inputs = [
        torch.randn(2, 200, 48, generator=gen),
        torch.randn(48, 1, 4, generator=gen),
        torch.randn(48, generator=gen),
    ]
    seq_idx = documents([2, 1, 100, 97], [200])
    upstream = torch.randn(2, 200, 48, generator=gen)

    def run(conv: Callable[..., torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
        leaves = [t.to(torch.bfloat16).to(dtype).requires_grad_() for t in inputs]
        out = conv(*leaves, seq_idx)
        out.backward(upstream.to(dtype))
        return [t.double() for t in (out, *(leaf.grad for leaf in leaves))]

    ours = run(triton_causal_conv.causal_depthwise_conv, torch.bfloat16)
    reference = run(_causal_depthwise_conv, torch.bfloat16)
    exact = run(_causal_depthwise_conv, torch.float64)
    for name, mine, theirs, truth in zip(
        ("out", "dx", "dw", "db"), ours, reference, exact, strict=True
    ):
        error, reference_error = ((t - truth).abs().max().item() for t in (mine, theirs))
        assert error <= reference_error, (name, error, reference_error)


def small_mixer() -> Mamba2Mixer:
    cfg = MambaConfig(heads=4, head_dim=8, state_size=16, groups=2, chunk_size=16, dt_limit_max=0.5)
    torch.manual_seed(4)
    mixer = Mamba2Mixer(32, cfg, 1e-5)
    with torch.no_grad():
        for parameter in mixer.parameters():
            parameter.copy_(torch.randn_like(parameter) * 0.3)
    return mixer


def count_kernel_calls(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """Calls that reach each of the three kernels from here on (the dispatches' own loaders
    hand out counting wrappers), so a test sees that the kernels ran, not only their values."""
    calls: Counter[str] = Counter()

    def counting(name: str, kernel: Callable[..., Any]) -> Callable[[], Callable[..., Any]]:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls[name] += 1
            return kernel(*args, **kwargs)

        return lambda: call

    monkeypatch.setattr(causal_conv, "_load", counting("conv", causal_conv._load()))
    monkeypatch.setattr(ssd, "_kernel", counting("scan", ssd._kernel()))
    monkeypatch.setattr(gated_norm, "_kernel", counting("norm", gated_norm._kernel()))
    return calls


def test_mixer_on_the_triton_path_equals_the_pytorch_path(
    field_kernels, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The whole mixer (conv, scan and gated norm on their kernels, each called once) with
    packed documents: output and every parameter's and the input's gradient equal the
    reference paths'."""
    calls = count_kernel_calls(monkeypatch)
    mixer = small_mixer()
    x = torch.randn(2, 24, 32, generator=torch.Generator().manual_seed(5))
    document_ids = documents([9, 15], [3, 21])
    choices = kernel_choices_cpu()  # "cpu" is a kernel device in this fixture
    assert [c.kernel for c in choices] == [causal_conv.TRITON, ssd.TRITON, gated_norm.TRITON]
    results = []
    for paths in (contextlib.nullcontext, reference_paths):
        mixer.zero_grad()
        leaf = x.clone().requires_grad_()
        with paths():
            out = mixer(leaf, document_ids)
            out.sin().sum().backward()
        results.append([out, leaf.grad, *(p.grad for p in mixer.parameters())])
    assert calls == {"conv": 1, "scan": 1, "norm": 1}  # the first pass only
    for ours, reference in zip(*results, strict=True):
        assert_close_to(ours.detach(), reference.detach())


def test_head_shard_mixes_the_same_on_both_paths(
    field_kernels, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Context parallelism's shard: the conv rows of a rank's heads and groups (gathered from
    the weight) and the scan of those heads over the whole sequence, kernel against reference."""
    mixer = small_mixer()
    cfg = mixer.cfg
    heads, groups = slice(2, 4), slice(1, 2)
    width = 2 * cfg.head_dim + 2 * cfg.state_size + 2  # x, B, C of the shard, and its dt
    whole = torch.randn(2, 24, width, generator=torch.Generator().manual_seed(6))
    document_ids = documents([7, 17], [24])
    calls = count_kernel_calls(monkeypatch)
    ours = mixer._mix(whole, document_ids, heads, groups)
    with reference_paths():
        reference = mixer._mix(whole, document_ids, heads, groups)
    assert calls == {"conv": 1, "scan": 1}
    assert_close_to(ours, reference)


def kernel_choices_cpu() -> list[KernelChoice]:
    return kernel_choices(SimpleNamespace(mamba=small_mixer().cfg), "cpu")  # reads .mamba only


@pytest.fixture
def fresh_loads() -> Iterator[None]:
    _forget_loaded_kernels()
    yield
    _forget_loaded_kernels()


def hide(monkeypatch: pytest.MonkeyPatch, package: str) -> None:
    """Make ``package`` look not installed to the loaders."""
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == package else find_spec(name, *a),
    )


def test_cuda_reports_the_field_kernels_when_they_import(fresh_loads) -> None:
    for package in ("triton", "mamba_ssm"):
        if importlib.util.find_spec(package) is None:
            if MUST_RUN:
                pytest.fail(f"{package} is not installed")
            pytest.skip(f"{package} is not installed")
    choices = kernel_choices(SimpleNamespace(mamba=small_mixer().cfg), "cuda")
    assert [c.kernel for c in choices] == [causal_conv.TRITON, ssd.TRITON, gated_norm.TRITON]
    assert all(c.fallback is None for c in choices)


def test_without_mamba_ssm_cuda_says_why_and_the_dispatch_falls_back(
    fresh_loads, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The report's reason comes from the same test the dispatch makes: with mamba_ssm missing,
    the scan and the norm report a fallback that names it, and a tensor the kernels would serve
    takes the PyTorch scan."""
    hide(monkeypatch, "mamba_ssm")
    cfg = small_mixer().cfg
    scan, norm = kernel_choices(SimpleNamespace(mamba=cfg), "cuda")[1:]
    assert (scan.kernel, norm.kernel) == (ssd.REFERENCE, gated_norm.REFERENCE)
    assert "mamba_ssm is not installed" in scan.fallback and norm.fallback == scan.fallback
    monkeypatch.setattr(mamba_ssm_triton, "DEVICE_TYPES", {"cuda", "cpu"})
    torch_scans = []
    reference = ssd.ssd_chunked_scan_torch
    monkeypatch.setattr(
        ssd, "ssd_chunked_scan_torch", lambda *a: torch_scans.append(1) or reference(*a)
    )
    gen = torch.Generator().manual_seed(7)
    inputs = ScanInputs(
        torch.randn(1, 8, 2, 4, generator=gen), torch.rand(1, 8, 2, generator=gen),
        -torch.rand(2, generator=gen), torch.randn(1, 8, 1, 4, generator=gen),
        torch.randn(1, 8, 1, 4, generator=gen),
    )  # fmt: skip
    ssd_chunked_scan(inputs, 16)
    assert torch_scans == [1]
    assert gated_norm.triton_gated_rmsnorm(inputs.x) is None


def test_without_triton_the_conv_says_why_and_runs_the_reference(
    fresh_loads, monkeypatch: pytest.MonkeyPatch
) -> None:
    hide(monkeypatch, "triton")
    choice = causal_conv.conv_kernel("cuda")
    assert (choice.kernel, choice.fallback) == (causal_conv.REFERENCE, "triton is not installed")
    assert ssd.ssd_kernel("cuda").fallback == "triton is not installed"
    monkeypatch.setattr(mamba_ssm_triton, "DEVICE_TYPES", {"cuda", "cpu"})
    assert causal_conv.triton_conv(torch.zeros(1, 4, 2)) is None


def test_cpu_reports_the_reference_paths_without_fallback() -> None:
    choices = kernel_choices_cpu()
    assert [c.kernel for c in choices] == [
        causal_conv.REFERENCE,
        ssd.REFERENCE,
        gated_norm.REFERENCE,
    ]
    assert all(c.fallback is None for c in choices)


def test_a_chunk_size_the_scan_kernel_refuses_is_reported() -> None:
    choice = ssd.ssd_kernel("cuda", chunk_size=24)
    assert choice.kernel == ssd.REFERENCE and "chunk_size 24" in choice.fallback
