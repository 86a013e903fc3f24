"""Quantized linears under tensor parallelism quantize as one process does
(``factory.distributed.quantized_tp``, ``factory.precision.splits``).

Every rank builds the same model with the precision policy applied (seed 0),
then a second copy split over TP=2. Each quantized linear is fed the same
full inputs and output gradients as its one-process twin (the TP module its
rank's share of them) and every operand its quantizer returns is recorded:
fprop's input and weight, dgrad's gradient and weight, wgrad's two token-major
operands. Each TP operand must equal, bit for bit, the rows and columns of the
one-process operand that this rank holds, which are rebuilt here from the
spec's segments (not read from the implementation); equal dequantized values
under the same global scale are equal codes and scales. Stochastic rounding is
on: the ranks must draw one process's random numbers for their elements.

The outputs and gradients then differ only by fp32 summation order (a row
linear's partial sums are added over the ranks): within ``SUM_ORDER_TOL``
relative to each tensor's largest entry.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from runtime_helpers import tiny_blueprint
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from factory.distributed.local import run_ranks
from factory.distributed.tensor_parallel import apply_tensor_parallel, check_tensor_parallel
from factory.graph.hybrid_lm import HybridLM
from factory.graph.init import initialize
from factory.layers.model_spec import model_spec
from factory.precision.apply import apply_precision
from factory.precision.qlinear import QuantizedLinear
from factory.schemas.blueprint import Blueprint
from factory.spec.tensors import Split

WORLD, TIMEOUT = 2, 240
SUM_ORDER_TOL = 1e-6
BATCH, SEQ = 2, 32

DENSE = {
    "pattern": "M*-",
    "mtp": None,
    "mlp": {"intermediate_size": 64},
    "attention": {"heads": 8, "kv_heads": 1, "head_dim": 8},
    "mamba": {"heads": 64, "head_dim": 8, "groups": 2, "state_size": 32},
}
"""Mamba (in_proj split by segments, every per-rank share 32-aligned for MXFP8), attention
(q column, k and v held whole: one KV head), an MLP (up column, down row)."""

MOE = {
    "pattern": "E",
    "mtp": None,
    "moe": {"shared_expert_intermediate_size": 64, "latent_size": 16, "num_experts": 8},
}
"""One LatentMoE layer; the shared expert's per-rank share (32) is whole NVFP4 blocks."""

RECIPES: dict[str, dict[str, Any]] = {
    "nvfp4 16x16 rht": {"recipe": "nvfp4", "nvfp4": {"weight_tile": "16x16", "hadamard": True}},
    "nvfp4 1x16": {"recipe": "nvfp4", "nvfp4": {"weight_tile": "1x16", "hadamard": False}},
    "mxfp8": {"recipe": "mxfp8"},
    "fp8 tensorwise": {"recipe": "fp8", "fp8": {"scaling": "tensorwise"}},
    "fp8 delayed": {"recipe": "fp8", "fp8": {"scaling": "delayed"}},
    "mor tensor": {"recipe": "mor"},
}
"""NVFP4 with stochastic rounding of gradients (the default) in both weight tilings."""

_OPERANDS = ("input", "weight", "grad", "dgrad_weight", "wgrad")
_DIMS = {
    "input": [("tokens", "in")],
    "weight": [("out", "in")],
    "grad": [("tokens", "out")],
    "dgrad_weight": [("out", "in")],
    "wgrad": [("out", "tokens"), ("in", "tokens")],
}
"""The (rows, columns) of each recorded operand; dgrad's weight is returned as [N, K]."""


def _blueprint(recipe: str, model: dict[str, Any], overrides: dict[str, str]) -> Blueprint:
    """The tiny blueprint with ``model``'s sections merged in, every GEMM in ``recipe`` but
    the ``overrides``."""
    sections = tiny_blueprint().model.model_dump()
    for key, value in model.items():
        sections[key] = {**(sections[key] or {}), **value} if isinstance(value, dict) else value
    precision = {**RECIPES[recipe], "overrides": overrides}
    precision["high_precision"] = {"first": 0, "last": 0, "layers": []}
    return tiny_blueprint(model=sections, precision=precision)


def _quantized(bp: Blueprint) -> HybridLM:
    net = HybridLM(bp.model)
    initialize(net, model_spec(bp.model), 0)
    apply_precision(net, bp, seed=0)
    return net.eval()


def _record(net: nn.Module) -> dict[str, list[tuple[str, Any]]]:
    """Wrap every quantizer method to log (method, result) per module, in call order."""
    logs: dict[str, list[tuple[str, Any]]] = {}
    for name, module in net.named_modules():
        if isinstance(module, QuantizedLinear):
            log = logs.setdefault(name, [])
            for method in _OPERANDS:
                setattr(module.quantizer, method, _logged(getattr(module.quantizer, method),
                                                          method, log))  # fmt: skip
    return logs


def _logged(fn: Callable[..., Any], method: str, log: list) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        out = fn(*args, **kwargs)
        log.append((method, out))
        return out

    return call


def _rank_major_positions(split: Split, width: int, rank: int) -> torch.Tensor:
    """One-process indices of this rank's chunk of every segment, in order."""
    widths = split.segments or (width,)
    starts = torch.tensor([0, *widths]).cumsum(0)
    return torch.cat([
        torch.arange(int(start) + rank * w // WORLD, int(start) + (rank + 1) * w // WORLD)
        for start, w in zip(starts, widths, strict=False)
    ])  # fmt: skip


def _operand_diffs(
    ref: list[tuple[str, Any]], tp: list[tuple[str, Any]], positions: dict[str, torch.Tensor]
) -> list[str]:
    """Each TP operand against its rows and columns of the one-process operand: mismatches."""
    if [m for m, _ in ref] != [m for m, _ in tp]:
        return [f"calls {[m for m, _ in tp]} != {[m for m, _ in ref]}"]
    bad = []
    for (method, want), (_, got) in zip(ref, tp, strict=True):
        for dims, w, g in zip(_DIMS[method], _tuple(want), _tuple(got), strict=True):
            for axis, dim in zip(dims, (-2, -1), strict=True):
                if axis in positions:
                    w = w.index_select(dim, positions[axis])
            if not torch.equal(w, g):
                count = (w != g).sum().item()
                bad.append(f"{method} {dims}: {count} of {w.numel()} values differ")
    return bad


def _tuple(x: Any) -> tuple[torch.Tensor, ...]:
    return x if isinstance(x, tuple) else (x,)


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max().clamp(min=1e-30)).item()


def _linear_worker(rank: int, world: int) -> dict[str, dict[str, Any]]:
    """Every quantized linear of the dense model, alone, under each recipe."""
    mesh = DeviceMesh("cpu", list(range(world)))
    results = {}
    for recipe in RECIPES:
        bp = _blueprint(recipe, DENSE, {})
        reference, split = _quantized(bp), _quantized(bp)
        apply_tensor_parallel(split, mesh, sequence_parallel=False)
        ref_logs, tp_logs = _record(reference), _record(split)
        specs = {t.module: t for t in model_spec(bp.model).tensors() if t.gemm is not None}
        for name, log in ref_logs.items():
            results[f"{recipe}: {name}"] = _compare_linear(
                reference.get_submodule(name), split.get_submodule(name), specs[name].tp,
                log, tp_logs[name], rank, seed=len(results),
            )  # fmt: skip
    return results


def _compare_linear(
    reference: QuantizedLinear,
    split: QuantizedLinear,
    tp_split: Split | None,
    ref_log: list,
    tp_log: list,
    rank: int,
    seed: int,
) -> dict[str, Any]:
    """Run both on one batch (two micro-batches: the second reuses the weight cast) and
    compare operands, output and gradients."""
    placement = split._parameters["weight"].placements[0]
    axis = {0: "out", 1: "in"}.get(getattr(placement, "dim", None))
    positions = {}
    if axis is not None and tp_split is not None:
        width = reference.weight.shape[tp_split.dim]
        positions[axis] = _rank_major_positions(tp_split, width, rank)
    out: dict[str, Any] = {"output": 0.0, "dx": 0.0, "dw": 0.0}
    for step in range(2):
        gen = torch.Generator().manual_seed(100 * seed + step)
        x = torch.randn(BATCH, SEQ, reference.in_features, generator=gen)
        dy = torch.randn(BATCH, SEQ, reference.out_features, generator=gen)
        x_ref, x_tp = x.clone().requires_grad_(), _share(x, positions.get("in")).requires_grad_()
        y_ref, y_tp = reference(x_ref), split(x_tp)
        y_ref.backward(dy)
        # A linear held whole sums the ranks' output gradients (each its own heads'): rank 0
        # gives all of it.
        held_whole = axis is None and rank > 0
        y_tp.backward(torch.zeros_like(y_tp) if held_whole else _share(dy, positions.get("out")))
        out["output"] = max(out["output"], _relative(y_tp, _share(y_ref, positions.get("out"))))
        out["dx"] = max(out["dx"], _relative(x_tp.grad, _share(x_ref.grad, positions.get("in"))))
    weight = split._parameters["weight"]
    assert isinstance(weight, DTensor) and weight.grad is not None
    want = reference.weight.grad
    if axis is not None:
        want = want.index_select({"out": 0, "in": 1}[axis], positions[axis])
    out["dw"] = _relative(weight.grad.to_local(), want)
    out["operands"] = _operand_diffs(ref_log, tp_log, positions)
    out["calls"] = len(tp_log)
    return out


def _share(t: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
    """This rank's features of ``t`` along its last dim (all of them when not split)."""
    return t.detach().clone() if positions is None else t.detach().index_select(-1, positions)


def _moe_worker(rank: int, world: int) -> dict[str, Any]:
    """A LatentMoE mixer under TP=2 with sequence parallelism: its shared expert (column up,
    row down) sees every rank's tokens gathered rank-major, its latent projections this
    rank's tokens. Routed experts stay BF16: each rank routes its own tokens to them."""
    bp = _blueprint("nvfp4 16x16 rht", MOE, {"*.experts.*": "bf16"})
    reference, split = _quantized(bp), _quantized(bp)
    apply_tensor_parallel(split, DeviceMesh("cpu", list(range(world))), sequence_parallel=True)
    ref_logs, tp_logs = _record(reference), _record(split)
    prefix = "backbone.layers.0.mixer"
    mine = torch.arange(rank * SEQ // world, (rank + 1) * SEQ // world)
    out: dict[str, Any] = {"output": 0.0}
    for step in range(2):
        gen = torch.Generator().manual_seed(step)
        x = torch.randn(BATCH, SEQ, bp.model.hidden_size, generator=gen)
        dy = torch.randn(BATCH, SEQ, bp.model.hidden_size, generator=gen)
        y_ref = reference.get_submodule(prefix)(x.clone().requires_grad_()).y
        y_tp = split.get_submodule(prefix)(x[:, mine].clone().requires_grad_()).y
        y_ref.backward(dy)
        y_tp.backward(dy[:, mine])
        out["output"] = max(out["output"], _relative(y_tp, y_ref[:, mine]))
    # Token t of sequence b is b * SEQ + t in one process's flattened micro-batch.
    shares = [(torch.arange(BATCH)[:, None] * SEQ + torch.arange(SEQ).chunk(world)[r]).reshape(-1)
              for r in range(world)]  # fmt: skip
    local, every = shares[rank], torch.cat(shares)
    with pytest.raises(ValueError) as short:  # 12 tokens a rank: not whole 16-token blocks
        split.get_submodule(prefix)(x[:, : SEQ // world - 4])
    out["short"] = str(short.value)
    specs = {t.module: t for t in model_spec(bp.model).tensors() if t.gemm is not None}
    for name in ref_logs:
        positions = {"tokens": local}
        if ".shared_experts." in name:
            tp_split = specs[name].tp
            assert tp_split is not None
            axis = "out" if tp_split.kind == "column" else "in"
            width = reference.get_submodule(name).weight.shape[tp_split.dim]
            positions = {"tokens": every, axis: _rank_major_positions(tp_split, width, rank)}
        out[name] = _operand_diffs(ref_logs[name], tp_logs[name], positions)
        out[f"{name} calls"] = len(tp_logs[name])
    return out


@pytest.fixture(scope="module")
def linear_results() -> list[dict[str, dict[str, Any]]]:
    return run_ranks(_linear_worker, WORLD, timeout=TIMEOUT)


def test_every_split_linear_quantizes_as_one_process(linear_results: list) -> None:
    """Column (MLP up, attention q), row (MLP down, Mamba out, attention o), Mamba's
    segment-split in_proj and the KV projections held whole, each recipe: every operand
    of every GEMM, both micro-batches, equals one process's bit for bit."""
    for result in linear_results:
        assert len(result) == len(RECIPES) * 8, sorted(result)
        bad = {name: r["operands"] for name, r in result.items() if r["operands"]}
        assert not bad, bad
        # One weight cast (the second micro-batch reuses it), then fprop's input, dgrad's
        # two operands and wgrad's pair per micro-batch.
        assert {r["calls"] for r in result.values()} == {9}


def test_outputs_and_gradients_differ_only_by_summation_order(linear_results: list) -> None:
    for result in linear_results:
        worst = {k: max(r[k] for r in result.values()) for k in ("output", "dx", "dw")}
        assert max(worst.values()) <= SUM_ORDER_TOL, worst


def test_routing_mixer_linears_quantize_as_one_process_under_sequence_parallel() -> None:
    """The shared expert's gathered tokens and the latent projections' own tokens: each
    operand is one process's, stochastic rounding included, at the one-process positions of
    the rank's tokens."""
    for result in run_ranks(_moe_worker, WORLD, timeout=TIMEOUT):
        names = [k for k in result if k.endswith("_proj")]
        assert len(names) == 4, names
        assert {result[f"{name} calls"] for name in names} == {9}
        bad = {name: result[name] for name in names if result[name]}
        assert not bad, bad
        assert result["output"] <= SUM_ORDER_TOL, result["output"]
        assert "12 tokens of each sequence" in result["short"], result["short"]


def test_refuses_splits_that_cut_blocks_or_linears_it_cannot_split() -> None:
    """The runtime says what ``precision.tp_blocks`` says: the tiny blueprint's 16 Mamba
    heads give each of 2 ranks 8 dt rows, half an NVFP4 block; and a linear that is neither
    nn.Linear nor QuantizedLinear (Transformer Engine's) is refused, not run on local views."""
    net = _quantized(_blueprint("nvfp4 16x16 rht", {}, {}))
    with pytest.raises(ValueError) as cut:
        check_tensor_parallel(net, 2, sequence_parallel=True)
    assert "in_proj.weight: its heads split gives each of tp=2 ranks 8 of 16" in str(cut.value)
    dense = _quantized(_blueprint("fp8 tensorwise", DENSE, {}))
    dense.backbone.layers[2].mixer.up_proj = _Opaque()
    with pytest.raises(ValueError) as opaque:
        check_tensor_parallel(dense, 2, sequence_parallel=False)
    assert "mixer.up_proj is a _Opaque" in str(opaque.value), str(opaque.value)


class _Opaque(nn.Module):
    """Stands in for a linear tensor parallelism cannot split (Transformer Engine's)."""
