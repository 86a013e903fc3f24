"""A new layer type is one module: this one.

It declares a gated linear unit mixer ``U`` (tensors, FLOPs, activation memory, its
module, its tensor-parallel split and rule, a check of its own, no Hugging Face or Megatron
equivalent) and, editing nothing else in factory, gets: a plan, validate rules of its own, a graph that
trains, a TP=2 run equal to one process (2 gloo ranks), a precision-table row, a CPU proxy
and an upcycled model that keep it, and clear refusals from both exports. ``CONTRIBUTING.md`` ("Adding a layer type") points here.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from blueprint_factory import make
from runtime_helpers import tiny_blueprint
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

import factory
from factory.checks.registry import run_rules
from factory.distributed.local import run_ranks
from factory.distributed.tensor_parallel import apply_tensor_parallel, reduce_partial_gradients
from factory.exports.hf_config import ExportError, hf_config
from factory.exports.megatron_refusals import refusals
from factory.graph.hybrid_lm import HybridLM
from factory.graph.init import initialize
from factory.graph.loss import language_model_loss
from factory.graph.upcycle import upcycle
from factory.layers.model_spec import model_spec
from factory.precision.policy import resolve_policy
from factory.proxy import proxy_pattern
from factory.spec.activations import BF16, TokenShards, prologue_bytes
from factory.spec.layer_type import (
    LayerFinding,
    LayerType,
    layer_check,
    register_layer_type,
    unregister_layer_type,
)
from factory.spec.tensors import Init, TensorSpec, linear

MAX_TP = 4
MAX_UNITS = 4


class GatedUnit(nn.Module):
    """y = down(silu(gate(x)) * up(x)): column-parallel gate and up, row-parallel down."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.gate = nn.Linear(width, 2 * width, bias=False)
        self.up = nn.Linear(width, 2 * width, bias=False)
        self.down = nn.Linear(2 * width, width, bias=False)

    def forward(self, x: torch.Tensor, document_ids: torch.Tensor | None = None) -> torch.Tensor:
        return self.down(nn.functional.silu(self.gate(x)) * self.up(x))  # token-wise


class GatedUnitType(LayerType):
    symbol = "U"
    name = "gated_unit"
    context_parallel = "token_wise"

    def mixer_tensors(self, model: Any, prefix: str) -> list[TensorSpec]:
        d, normal = model.hidden_size, Init("normal")
        return [
            *linear(f"{prefix}.gate", d, 2 * d, bias=False, tp="column", init=normal),
            *linear(f"{prefix}.up", d, 2 * d, bias=False, tp="column", init=normal),
            *linear(f"{prefix}.down", 2 * d, d, bias=False, tp="row", init=Init("scaled_normal")),
        ]

    def activation_bytes(self, model: Any, tokens: TokenShards, recompute: str) -> float:
        return prologue_bytes(tokens, model.hidden_size) + BF16 * tokens.sharded(
            6 * model.hidden_size
        )

    def tp_rules(self, model: Any, tp: int) -> list[str]:
        """Gated units split at most MAX_TP ways (a rule of this layer type alone)."""
        return [f"tp={tp}: gated units split at most {MAX_TP} ways"] if tp > MAX_TP else []

    @layer_check("model.gated_unit_count")
    def few_units(self, bp: Any) -> Iterator[LayerFinding]:
        """At most MAX_UNITS gated units per stack (a check of this layer type alone)."""
        count = bp.model.parsed_pattern.main.count(self.symbol)
        if count > MAX_UNITS:
            yield "model.pattern", f"{count} gated units, more than {MAX_UNITS}", "warning"

    def build(self, model: Any) -> nn.Module:
        return GatedUnit(model.hidden_size)


@pytest.fixture
def gated_unit() -> Iterator[None]:
    register_layer_type(GatedUnitType)
    yield
    unregister_layer_type("U")


def test_it_is_planned_validated_and_refused_by_both_exports(gated_unit) -> None:
    bp = make(**{"model.pattern": "MU*EU-", "precision.recipe": "nvfp4"})
    d = bp.model.hidden_size
    plan = factory.plan(bp)
    assert plan.params.by_layer_type["gated_unit"]["per_layer"] == 6 * d * d + d  # + pre-norm
    assert plan.flops_per_token.by_layer_type["gated_unit"] == 2 * 3 * 2 * (6 * d * d)
    assert plan.memory.activations.per_layer_type["gated_unit"] > 0

    said = {r.name: f.message for r, f in run_rules(make(**{"model.pattern": "MU*EU-",
                                                            "parallelism.tp": 8}))}  # fmt: skip
    assert said["parallelism.tp_gated_unit"] == f"tp=8: gated units split at most {MAX_TP} ways"
    assert "model.gated_unit_count" not in said
    many = run_rules(make(**{"model.pattern": "MUUUUU*E"}))
    (warning,) = [f for r, f in many if r.name == "model.gated_unit_count"]
    assert (warning.path, warning.severity) == ("model.pattern", "warning")
    assert warning.message == f"5 gated units, more than {MAX_UNITS}"

    table = {row.name: row.recipe for row in resolve_policy(bp)}
    assert table["backbone.layers.1.mixer.down"] == "nvfp4"
    with pytest.raises(ExportError, match="'gated_unit' layers \\('U'\\) have no NemotronH"):
        hf_config(bp)
    assert ("model.pattern", "'gated_unit' layers ('U') have no Megatron-Core equivalent") in (
        refusals(bp)
    )


def test_its_graph_trains(gated_unit) -> None:
    bp = make(**{"model.pattern": "MU*EU-"})
    compiled = factory.compile(bp, precision="off")
    model = compiled.model
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ids = torch.randint(0, bp.model.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(8):
        loss = language_model_loss(model(ids), ids, mtp_loss_scale=0.3).total
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.9 * losses[0], losses


def test_its_proxy_and_upcycling_keep_it(gated_unit, monkeypatch: pytest.MonkeyPatch) -> None:
    assert proxy_pattern("MUME*MUME*MUME*-") == "MUME*MUME*-"
    monkeypatch.setattr(GatedUnitType, "ends_period", True)  # its own periods, if it says so
    assert proxy_pattern("MUME*MUME*MUME*-") == "MUME*-"

    dense = factory.compile(make(**{"model.pattern": "MU*-"}), precision="off").model.eval()
    bp = make(**{"model.pattern": "MU*E", "model.moe.top_k": 4})  # 4 = 512 / 128 shards
    # Initialised first, as factory.compile does before it upcycles: to_empty's memory would
    # leave whatever upcycling does not write (buffers) holding garbage, NaN included.
    moe = factory.compile(bp, precision="off").model
    upcycle(moe, dense.state_dict(), torch.Generator().manual_seed(0))
    unit, seeded = dense.backbone.layers[1].mixer, moe.backbone.layers[1].mixer
    assert all(
        torch.equal(a, b) for a, b in zip(unit.parameters(), seeded.parameters(), strict=True)
    )
    ids = torch.randint(0, bp.model.vocab_size, (1, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(moe.eval()(ids).logits, dense(ids).logits)


def _tp_worker(rank: int, world: int) -> dict[str, float]:
    register_layer_type(GatedUnitType)  # a spawned process imports this module afresh
    cfg = tiny_blueprint(model={"pattern": "MU*U", "mlp": None, "moe": None, "mtp": None}).model
    reference, split = HybridLM(cfg), HybridLM(cfg)
    for net in (reference, split):
        initialize(net, model_spec(cfg), seed=0)
    ids = torch.randint(0, cfg.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
    expected = reference(ids)
    language_model_loss(expected, ids, mtp_loss_scale=0.0).total.backward()
    apply_tensor_parallel(split, DeviceMesh("cpu", list(range(world))), sequence_parallel=False)
    out = split(ids)
    language_model_loss(out, ids, mtp_loss_scale=0.0).total.backward()
    reduce_partial_gradients(split)
    diffs = {"logits": (out.logits - expected.logits).abs().max().item()}
    params = dict(split.named_parameters())
    for name, param in reference.named_parameters():
        if ".mixer." in name and name.split(".")[2] in ("1", "3"):  # the gated units
            grad = params[name].grad
            assert isinstance(grad, DTensor), name
            diffs[name] = (grad.full_tensor() - param.grad).abs().max().item()
    return diffs


def test_tensor_parallel_equals_one_process() -> None:
    for diffs in run_ranks(_tp_worker, 2, timeout=120):
        assert len(diffs) == 1 + 2 * 3  # logits, and the three weights of both gated units
        assert max(diffs.values()) < 1e-5, diffs
