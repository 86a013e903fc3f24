"""A new precision recipe is one module: this one.

It declares ``mxfp6``, OCP MXFP6 (E3M2 elements with a power-of-two scale per 32 along the
reduction dimension), as a maintainer would in ``schemas/precision_recipes/mxfp6.py``: its
record (blocks, the bytes a quantized GEMM input keeps, the tensor-core format whose peak it
runs at, its colour, a validate rule of its own, no Transformer Engine or Megatron name) and
its quantizer, the emulation. Editing nothing in factory, a blueprint naming it validates,
plans with its numbers, gets its rows in the precision table and its colour in the layer
stack, compiles to a graph that trains with it, and both Megatron paths refuse it by name.
``CONTRIBUTING.md`` ("Adding a precision recipe") points here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest
import torch
from blueprint_factory import DELETE, assert_fires, findings, make
from pydantic import ValidationError

import factory
from factory.checks import RULES, Finding
from factory.checks.registry import run_rules, sync_registered_rules
from factory.exports.megatron_fields import megatron_fields
from factory.exports.megatron_refusals import refusals
from factory.exports.quant_recipe import QuantRecipeError, megatron_quant_recipe
from factory.graph.loss import language_model_loss
from factory.json_schema import described_schema
from factory.planner.plan import Plan
from factory.precision.policy import flops_share, resolve_policy
from factory.precision.qlinear import QuantizedLinear
from factory.precision.quantizers import GemmQuantizer
from factory.precision.splits import WHOLE_GEMM, GemmSplit
from factory.precision.te_backend import te_recipe
from factory.report.layer_stack import layer_stack_svg, precision_colour
from factory.schemas import Blueprint
from factory.schemas.precision_recipes import (
    PRECISION_RECIPES,
    PrecisionRecipe,
    RecipeCheck,
    RecipeFinding,
    recipe_named,
    register_recipe,
    unregister_recipe,
)

BLOCK = 32
E3M2_MAX, E3M2_EMAX, E3M2_EMIN, E3M2_MANTISSA = 28.0, 4, -2, 2
COLOUR = "#6a3d9a"


# --- the torch side: the emulation ---------------------------------------------------------------


def _mxfp6(x: torch.Tensor) -> torch.Tensor:
    """E3M2 values with a power-of-two scale per 32 elements of the last dim, dequantized."""
    width = x.shape[-1]
    padded = torch.nn.functional.pad(x, (0, -width % BLOCK))
    blocks = padded.reshape(*padded.shape[:-1], -1, BLOCK)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    scale = torch.exp2(torch.floor(torch.log2(amax.clamp_min(2.0**-126))) - E3M2_EMAX)
    v = blocks / scale
    exponent = torch.floor(torch.log2(v.abs().clamp_min(2.0**E3M2_EMIN))).clamp_min(E3M2_EMIN)
    step = torch.exp2(exponent - E3M2_MANTISSA)
    q = (torch.round(v / step) * step).clamp(-E3M2_MAX, E3M2_MAX) * scale
    return q.reshape(padded.shape)[..., :width]


def _t(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(-1, -2)


class MXFP6Quantizer(GemmQuantizer):
    """Every operand blocked along the dimension its GEMM reduces (one process only: it never
    asks ``split``, so it keeps ``precision.tp_blocks``' whole blocks and no more)."""

    recipe = "mxfp6"

    def input(self, x: torch.Tensor, split: GemmSplit = WHOLE_GEMM) -> torch.Tensor:
        return _mxfp6(x)

    def weight(self, w: torch.Tensor, split: GemmSplit = WHOLE_GEMM) -> torch.Tensor:
        return _mxfp6(w)

    def dgrad_weight(
        self, w: torch.Tensor, w_fprop: torch.Tensor | None, split: GemmSplit = WHOLE_GEMM
    ) -> torch.Tensor:
        return _t(_mxfp6(_t(w)))

    def grad(self, dy: torch.Tensor, split: GemmSplit = WHOLE_GEMM) -> torch.Tensor:
        return _mxfp6(dy)

    def wgrad(
        self,
        dy: torch.Tensor,
        x: torch.Tensor,
        dy_q: torch.Tensor | None = None,
        x_q: torch.Tensor | None = None,
        split: GemmSplit = WHOLE_GEMM,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return _mxfp6(_t(dy)), _mxfp6(_t(x))


# --- the record: what schemas/precision_recipes/mxfp6.py would hold ------------------------------


def bf16_ends(bp: Blueprint) -> Iterator[RecipeFinding]:
    """MXFP6 keeps the first and last layers in BF16 (a rule of this recipe alone)."""
    hp = bp.precision.high_precision
    if not (hp.first and hp.last):
        yield "precision.high_precision", "mxfp6 wants the first and last layers in BF16", "warning"


MXFP6 = PrecisionRecipe(
    name="mxfp6",
    title="MXFP6",
    quantizes=True,
    peak_format="mxfp8",  # Blackwell runs FP6 GEMMs at the MXFP8 rate
    saved_input_bytes=0.75 + 1 / BLOCK,
    colour=COLOUR,
    split_block=lambda options: BLOCK,
    quantizer=f"{__name__}.MXFP6Quantizer",
    checks=(RecipeCheck("precision.mxfp6_bf16_ends", bf16_ends),),
)


@pytest.fixture
def mxfp6() -> Iterator[None]:
    """The recipe registered as its registry entry would register it, for this test only (the
    shipped registry holds exactly the shipped recipes elsewhere)."""
    register_recipe(MXFP6)
    yield
    unregister_recipe("mxfp6")
    sync_registered_rules()  # its rule leaves RULES now, not at the next validate


@pytest.fixture
def twin() -> Iterator[PrecisionRecipe]:
    """MXFP6 with MXFP8's numbers: it must plan exactly as mxfp8 does."""
    record = dataclasses.replace(
        MXFP6, name="mxfp8_twin", saved_input_bytes=recipe_named("mxfp8").saved_input_bytes
    )
    register_recipe(record)
    yield record
    unregister_recipe("mxfp8_twin")


def _own_rule(bp: Blueprint) -> list[Finding]:
    """What the recipe's rule says, run as ``factory validate`` runs every rule."""
    return [f for r, f in run_rules(bp) if r.name == "precision.mxfp6_bf16_ends"]


def _recipe_enum() -> list[str]:
    return described_schema(Blueprint)["$defs"]["PrecisionConfig"]["properties"]["recipe"]["enum"]


def test_it_validates_only_while_registered(mxfp6) -> None:
    bp = make(**{"precision.recipe": "mxfp6", "precision.overrides": {"*.q_proj": "mxfp6"}})
    assert bp.precision.low_precision_recipes == ["mxfp6"]
    assert _recipe_enum()[-1] == "mxfp6"
    (warning,) = _own_rule(bp)
    assert warning.severity == "warning"
    ends = make(
        **{"precision.recipe": "mxfp6", "precision.high_precision": {"first": 1, "last": 1}}
    )
    assert _own_rule(ends) == []
    assert _own_rule(make(**{"precision.overrides": {"*.q_proj": "mxfp6"}})) == []  # no default
    # Hopper has no MX tensor cores: the GPU table, not the recipe, says so.
    assert_fires(
        "precision.hardware_support",
        bp,
        "precision.recipe",
        "MXFP6",
        "b200",
        "h100",
        severity="warning",
    )
    assert findings("precision.hardware_support", make(**{"precision.recipe": "mxfp6",
                                                           "parallelism.gpu": "gb200"})) == []  # fmt: skip
    # Its 32-element blocks: 16 of the 32 B/C rows of Mamba's in_proj per rank at tp=2.
    split = make(**{"precision.recipe": "mxfp6", "parallelism.tp": 2, "model.mamba.heads": 64})
    assert_fires("precision.tp_blocks", split, "parallelism.tp", "32-element mxfp6")


def test_it_is_refused_once_unregistered() -> None:
    with pytest.raises(
        ValidationError, match="Input should be 'bf16', 'fp8', 'nvfp4', 'mxfp8' or 'mor'"
    ):
        make(**{"precision.recipe": "mxfp6"})
    assert "mxfp6" not in PRECISION_RECIPES and "mxfp6" not in _recipe_enum()
    assert "precision.mxfp6_bf16_ends" not in RULES


def test_it_plans_with_its_numbers(mxfp6, twin) -> None:
    def planned(recipe: str, gpu: str) -> Plan:
        return factory.plan(make(**{"precision.recipe": recipe, "parallelism.gpu": gpu}))

    # A recipe with MXFP8's numbers plans as MXFP8, memory and speed, with or without tensor
    # cores for its format.
    for gpu in ("b200", "h100"):
        ours, theirs = planned(twin.name, gpu), planned("mxfp8", gpu)
        assert ours.memory.to_dict() == theirs.memory.to_dict()
        assert ours.performance.step_seconds == theirs.performance.step_seconds
        assert ours.performance.peak_format == theirs.performance.peak_format
    # Its own bytes: an E3M2 input keeps less than an MXFP8 one, more than NVFP4's.
    mxfp6, mxfp8, nvfp4 = (
        planned(r, "b200").memory.activations for r in ("mxfp6", "mxfp8", "nvfp4")
    )
    for kind in ("mlp", "moe"):
        assert nvfp4.per_layer_type[kind] < mxfp6.per_layer_type[kind] < mxfp8.per_layer_type[kind]
    assert planned("mxfp6", "b200").performance.peak_format == "mxfp8"
    assert planned("mxfp6", "h100").performance.peak_format == "bf16"  # emulated


def test_it_has_rows_in_the_precision_table_and_a_colour(mxfp6) -> None:
    bp = make(**{"precision.recipe": "mxfp6", "precision.high_precision": {"first": 1}})
    table = resolve_policy(bp)
    formats = {row.recipe for row in table}
    assert formats == {"mxfp6", "bf16"}
    assert {row.recipe for row in table if row.layer == 0} == {"bf16"}
    assert 0 < flops_share(table)["mxfp6"] < 1
    assert precision_colour("mxfp6") == COLOUR
    picture = layer_stack_svg([[bp.model.parsed_pattern.main]], bp.model.mtp_pattern,
                              [dataclasses.asdict(row) for row in table])  # fmt: skip
    assert f'fill="{COLOUR}"' in picture and ">MXFP6<" in picture


def test_megatron_refuses_it_by_name(mxfp6) -> None:
    bp = make(**{"precision.recipe": "mxfp6"})
    assert ("precision.recipe", "MXFP6 has no Megatron recipe") in refusals(bp)
    assert megatron_fields(bp)["mixed_precision"]["name"] == "bf16_mixed"
    mixed = make(**{"precision.recipe": "nvfp4", "precision.overrides": {"*.out_proj": "mxfp6"}})
    with pytest.raises(QuantRecipeError, match="'mxfp6' has no Megatron per-module recipe"):
        megatron_quant_recipe(mixed)
    assert te_recipe("mxfp6", bp.precision) is None  # no TE recipe: the emulation runs it


def test_its_graph_trains(mxfp6) -> None:
    bp = make(**{"precision.recipe": "mxfp6", "model.pattern": "M*-", "model.moe": DELETE})
    compiled = factory.compile(bp, precision="emulate")
    model, runtime = compiled.model, compiled.precision
    assert runtime is not None
    quantized = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    assert quantized and all(isinstance(m.quantizer, MXFP6Quantizer) for m in quantized)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ids = torch.randint(0, bp.model.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(8):
        loss = language_model_loss(model(ids), ids, mtp_loss_scale=0.3).total
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        runtime.weights_updated()
        losses.append(loss.item())
    assert losses[-1] < 0.9 * losses[0], losses


def test_the_emulation_rounds_to_e3m2() -> None:
    """E3M2 values times a block's power-of-two scale stay as they are; others round to the
    nearest (a step of 0.25 between 1 and 2)."""
    grid = torch.tensor([0.25, 0.5, 1.0, 1.25, 1.5, 1.75, 28.0, -24.0] * 4)
    assert torch.equal(_mxfp6(grid * 8.0), grid * 8.0)
    between = torch.tensor([1.1, 1.2, -1.65, 28.0] + [0.0] * 28)
    assert torch.equal(_mxfp6(between)[:4], torch.tensor([1.0, 1.25, -1.75, 28.0]))
