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
    blocks are compiled (the MoE block, left eager under training.compile, says why), then
    each extra source's entries (the precision GEMMs' and the loss's plug in the same way)."""
    from runtime_helpers import tiny_blueprint

    import factory
    from factory.compilation import Compiled
    from factory.graph.block_compile import compile_blocks
    from factory.kernels.choice import KernelChoice
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
    assert "kernels: moe block: eager (fallback: its shapes depend on the data" in " ".join(lines)

    def loss(compiled: Compiled, device: str) -> list[tuple[str, KernelChoice]]:
        return [("loss", KernelChoice("cross entropy", "PyTorch"))]

    extended = run_kernel_lines(compiled, "cpu", (*KERNEL_SOURCES, loss))
    assert extended == [*lines, "kernels: loss cross entropy: PyTorch"]
