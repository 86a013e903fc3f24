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
