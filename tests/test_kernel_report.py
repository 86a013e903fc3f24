"""The kernel report: every layer type a model builds names its kernels, and on CPU none is a
fallback (the PyTorch paths are the reference there by design)."""

from __future__ import annotations

import pytest

from factory.graph.kernel_report import kernel_choices, kernel_lines
from factory.loading.blueprint import read_blueprint, resolve_source
from factory.spec.layer_type import LAYER_TYPES


@pytest.fixture(scope="module")
def nano_model():
    blueprint, _ = read_blueprint(resolve_source("nano"))
    return blueprint.model


def test_every_layer_type_used_reports_its_kernels(nano_model) -> None:
    reported = {name for name, _ in kernel_choices(nano_model, "cpu")}
    used = {layer.name for layer in LAYER_TYPES.values() if layer.used_by(nano_model)}
    assert reported == used


def test_cpu_takes_the_reference_paths_without_fallback(nano_model) -> None:
    assert all(choice.fallback is None for _, choice in kernel_choices(nano_model, "cpu"))


def test_lines_name_layer_operation_and_kernel(nano_model) -> None:
    lines = kernel_lines(nano_model, "cpu")
    ops = [(name, choice.op) for name, choice in kernel_choices(nano_model, "cpu")]
    assert len(lines) == len(ops)
    for line, (name, op) in zip(lines, ops, strict=True):
        assert line.startswith(f"kernels: {name} {op}: ")


def test_a_run_adds_how_each_layer_types_blocks_run_and_any_source() -> None:
    """``factory.runtime.run_kernels``: the layer types' lines, then per layer type whether its
    blocks are compiled (a MoE block whose dispatch reads the host stays eager and says why),
    then each extra source's entries."""
    from runtime_helpers import tiny_blueprint

    import factory
    from factory.compilation import Compiled
    from factory.graph.block_compile import compile_blocks
    from factory.kernels.choice import KernelChoice
    from factory.layers.moe.module import RoutedExperts
    from factory.runtime.run_kernels import KERNEL_SOURCES, run_kernel_lines

    bp = tiny_blueprint(training={"compile": True})
    compiled = factory.compile(bp, seed=0, precision="off")
    eager = run_kernel_lines(compiled, "cpu")
    assert eager[: len(kernel_lines(bp.model, "cpu"))] == kernel_lines(bp.model, "cpu")
    assert "kernels: mamba block: eager" in eager
    compile_blocks(compiled.model, backend="aot_eager")  # lazy: nothing is traced here
    lines = run_kernel_lines(compiled, "cpu")
    assert "kernels: mamba block: torch.compile (aot_eager)" in lines
    assert "kernels: attention block: torch.compile (aot_eager)" in lines
    assert "kernels: moe block: torch.compile (aot_eager)" in lines  # the sync-free dispatch

    forced = factory.compile(bp, seed=0, precision="off")
    for module in forced.model.modules():
        if isinstance(module, RoutedExperts):
            module.path = "padded_bmm"  # reads the largest count on the host
    compile_blocks(forced.model, backend="aot_eager")
    assert "kernels: moe block: eager (fallback: the expert path is forced to padded_bmm)" in (
        run_kernel_lines(forced, "cpu")
    )

    def loss(compiled: Compiled, device: str) -> list[tuple[str, KernelChoice]]:
        return [("loss", KernelChoice("cross entropy", "PyTorch"))]

    extended = run_kernel_lines(compiled, "cpu", (*KERNEL_SOURCES, loss))
    assert extended == [*lines, "kernels: loss cross entropy: PyTorch"]


def test_a_run_reports_its_precision_gemms_and_its_head_loss() -> None:
    """The precision policy's recipes (the tiny Super proxy keeps NVFP4) and the LM head's loss
    close the run's report, each answered by the dispatch's own test."""
    from runtime_helpers import tiny_blueprint

    import factory
    from factory.graph.loss import loss_kernel
    from factory.runtime.run_kernels import run_kernel_lines

    bp = tiny_blueprint()
    compiled = factory.compile(bp, seed=0, precision="emulate")
    lines = run_kernel_lines(compiled, "cpu")
    gemms = [line for line in lines if line.startswith("kernels: precision ")]
    choices = compiled.precision.kernel_choices("cpu")
    assert [c.op for c in choices] == ["nvfp4 gemm", "mxfp8 gemm"]
    assert gemms == [f"kernels: precision {c.describe()}" for c in choices]
    assert lines[-1] == f"kernels: head {loss_kernel(bp.model, 'cpu').describe()}"
