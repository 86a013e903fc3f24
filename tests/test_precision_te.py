"""The Transformer Engine mapping, checked against a fake ``transformer_engine`` package
(TE needs CUDA and cannot be installed here): which TE recipe each format becomes, and
how linears are swapped."""

from __future__ import annotations

import contextlib
import importlib.util
import sys
import types
from collections.abc import Iterator

import pytest
import torch
from torch import nn

import factory
from factory.checks.validate import load_blueprint
from factory.compilation import Compiled
from factory.precision import te_backend
from factory.precision.qlinear import QuantizedExpertLinear, QuantizedLinear
from factory.proxy import derive_proxy
from factory.schemas.blueprint import Blueprint
from factory.schemas.precision import FP8Options, NVFP4Options, PrecisionConfig

EXPERTS = ".experts."


@pytest.fixture(scope="module")
def ids() -> torch.Tensor:
    return torch.randint(0, 4096, (2, 64), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def plain() -> Compiled:
    return factory.compile(load_blueprint("super"), proxy=True, seed=0, precision="off")


# --- Transformer Engine mapping, with a fake transformer_engine ---------------------------------


class _Recorded:
    """A TE recipe stand-in that keeps its constructor's kwargs."""

    def __init__(self, **kwargs: object) -> None:
        self.kwargs = kwargs


def _fake_te(monkeypatch: pytest.MonkeyPatch) -> types.SimpleNamespace:
    """Install ``transformer_engine{,.common,.common.recipe,.pytorch}`` in sys.modules."""
    recipe = types.ModuleType("transformer_engine.common.recipe")
    for name in (
        "NVFP4BlockScaling",
        "MXFP8BlockScaling",
        "DelayedScaling",
        "Float8CurrentScaling",
        "Float8BlockScaling",
    ):
        setattr(recipe, name, type(name, (_Recorded,), {}))
    recipe.Format = types.SimpleNamespace(E4M3="E4M3", HYBRID="HYBRID")

    active: list[object] = []
    calls: list[tuple[str, object]] = []

    class Linear(nn.Linear):
        def __init__(
            self,
            in_features: int,
            out_features: int,
            bias: bool = True,
            params_dtype: torch.dtype | None = None,
            device: torch.device | None = None,
        ) -> None:
            super().__init__(
                in_features, out_features, bias=bias, dtype=params_dtype, device=device
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            calls.append((type(active[-1]).__name__ if active else "none", self))
            return super().forward(x)

    @contextlib.contextmanager
    def autocast(enabled: bool = True, recipe: object = None) -> Iterator[None]:
        active.append(recipe)
        try:
            yield
        finally:
            active.pop()

    pytorch = types.ModuleType("transformer_engine.pytorch")
    pytorch.Linear = Linear
    pytorch.autocast = autocast
    common = types.ModuleType("transformer_engine.common")
    common.recipe = recipe
    package = types.ModuleType("transformer_engine")
    package.common, package.pytorch = common, pytorch
    monkeypatch.setitem(sys.modules, "transformer_engine", package)
    monkeypatch.setitem(sys.modules, "transformer_engine.common", common)
    monkeypatch.setitem(sys.modules, "transformer_engine.common.recipe", recipe)
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", pytorch)
    return types.SimpleNamespace(recipe=recipe, pytorch=pytorch, calls=calls)


@pytest.mark.parametrize("hadamard", [True, False])
@pytest.mark.parametrize("stochastic_rounding", [True, False])
@pytest.mark.parametrize("weight_tile", ["16x16", "1x16"])
def test_te_recipe_nvfp4(
    monkeypatch: pytest.MonkeyPatch, hadamard: bool, stochastic_rounding: bool, weight_tile: str
) -> None:
    _fake_te(monkeypatch)
    options = NVFP4Options(
        hadamard=hadamard, stochastic_rounding=stochastic_rounding, weight_tile=weight_tile
    )
    recipe = te_backend.te_recipe("nvfp4", PrecisionConfig(nvfp4=options))
    assert type(recipe).__name__ == "NVFP4BlockScaling"
    assert recipe.kwargs == {
        "disable_rht": not hadamard,
        "disable_stochastic_rounding": not stochastic_rounding,
        "disable_2d_quantization": weight_tile != "16x16",
    }


@pytest.mark.parametrize(
    ("options", "name", "kwargs"),
    [
        (FP8Options(), "Float8CurrentScaling", {"fp8_format": "HYBRID"}),
        (FP8Options(format="e4m3"), "Float8CurrentScaling", {"fp8_format": "E4M3"}),
        (
            FP8Options(
                scaling="delayed", amax_history_len=16, amax_compute="most_recent", margin=2
            ),
            "DelayedScaling",
            {
                "fp8_format": "HYBRID",
                "amax_history_len": 16,
                "amax_compute_algo": "most_recent",
                "margin": 2,
            },
        ),
        (
            FP8Options(scaling="delayed", format="e4m3"),
            "DelayedScaling",
            {
                "fp8_format": "E4M3",
                "amax_history_len": 1024,
                "amax_compute_algo": "max",
                "margin": 0,
            },
        ),
        # TE's Float8BlockScaling is E4M3 only: the format option is not passed on.
        (FP8Options(scaling="blockwise"), "Float8BlockScaling", {"fp8_format": "E4M3"}),
        (
            FP8Options(scaling="blockwise", format="e4m3"),
            "Float8BlockScaling",
            {"fp8_format": "E4M3"},
        ),
    ],
)
def test_te_recipe_fp8(
    monkeypatch: pytest.MonkeyPatch, options: FP8Options, name: str, kwargs: dict[str, object]
) -> None:
    _fake_te(monkeypatch)
    recipe = te_backend.te_recipe("fp8", PrecisionConfig(fp8=options))
    assert type(recipe).__name__ == name
    assert recipe.kwargs == kwargs


def test_te_recipe_mxfp8_and_mor(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_te(monkeypatch)
    recipe = te_backend.te_recipe("mxfp8", PrecisionConfig())
    assert type(recipe).__name__ == "MXFP8BlockScaling"
    assert recipe.kwargs == {"fp8_format": "E4M3"}
    assert te_backend.te_recipe("mor", PrecisionConfig()) is None


needs_no_te = pytest.mark.skipif(
    importlib.util.find_spec("transformer_engine") is not None,
    reason="Transformer Engine is installed",
)


@needs_no_te
def test_te_is_not_available_here() -> None:
    assert "transformer_engine" not in sys.modules
    assert te_backend.available() is False
    assert te_backend.usable(torch.device("cpu")) is False


@needs_no_te
def test_compile_with_te_but_without_it_raises_a_clear_import_error() -> None:
    """Before building anything, with the install hint."""
    with pytest.raises(ImportError, match=r"Transformer Engine.*factory\[gpu\]"):
        factory.compile(load_blueprint("super"), proxy=True, device="meta", precision="te")


def test_auto_on_cpu_emulates_even_with_te_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_te(monkeypatch)
    compiled = factory.compile(load_blueprint("super"), proxy=True, device="meta")
    assert compiled.precision is not None
    assert not any(isinstance(m, te_backend.TELinear) for m in compiled.model.modules())
    assert any(isinstance(m, QuantizedLinear) for m in compiled.model.modules())


def test_apply_te_swaps_linears_with_a_te_recipe(
    monkeypatch: pytest.MonkeyPatch, plain: Compiled, ids: torch.Tensor
) -> None:
    fake = _fake_te(monkeypatch)
    compiled = factory.compile(load_blueprint("super"), proxy=True, seed=0, precision="te")
    runtime, model = compiled.precision, compiled.model
    assert runtime is not None
    assert list(model.state_dict()) == list(plain.model.state_dict())
    expected = {"nvfp4": "NVFP4BlockScaling", "mxfp8": "MXFP8BlockScaling"}
    te_linears = {}
    for row in runtime.table:
        if EXPERTS in row.name:
            continue
        module = model.get_submodule(row.name)
        if row.recipe == "bf16":
            assert type(module) is nn.Linear
            continue
        assert isinstance(module, te_backend.TELinear), row.name
        inner = module._te[0]
        assert inner.weight is module.weight
        te_linears[id(inner)] = expected[row.recipe]
    assert te_linears
    assert {id(op) for op in runtime.ops} >= {
        id(m) for m in model.modules() if isinstance(m, te_backend.TELinear)
    }
    expert_ops = [op for op in runtime.ops if isinstance(op, QuantizedExpertLinear)]
    assert expert_ops  # grouped experts stay on the emulated path
    for op in expert_ops:  # (their weight quantization dominates a CPU forward's time)
        op.quantize_forward = op.quantize_backward = False
    model.eval()
    with torch.no_grad():
        logits = model(ids[:, :16]).logits
    assert torch.isfinite(logits).all()
    seen = {id(inner): recipe for recipe, inner in fake.calls}
    assert seen == te_linears  # every TE linear ran, under its own format's recipe


@pytest.mark.parametrize(("tp", "on_te"), [(1, True), (2, False)])
def test_auto_on_cuda_takes_te_unless_tensor_parallel(
    monkeypatch: pytest.MonkeyPatch, tp: int, on_te: bool
) -> None:
    """factory does not split TE's linears yet: under TP, auto emulates instead."""
    _fake_te(monkeypatch)
    monkeypatch.setattr(te_backend, "usable", lambda device: True)
    data = derive_proxy(load_blueprint("super")).model_dump(exclude_unset=True)
    data["parallelism"].update(world_size=tp, tp=tp, sequence_parallel=True)
    compiled = factory.compile(Blueprint.model_validate(data), device="meta")
    te_linears = [m for m in compiled.model.modules() if isinstance(m, te_backend.TELinear)]
    assert bool(te_linears) is on_te
    assert any(isinstance(m, QuantizedLinear) for m in compiled.model.modules()) is not on_te
