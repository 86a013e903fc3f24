"""The GPU benchmark's Nano-width slice (``benchmarks/blueprints/gpu_nano_slice.yaml``) is Nano
with fewer layers and fewer routed experts, nothing else: every width, the routing and the
pattern's period equal ``blueprints/nano.yaml``'s, so a token's FLOPs in each layer are
Nano's, and the plan fits it on one H100 with its optimizer state."""

from __future__ import annotations

from pathlib import Path

import pytest

import factory
from factory.planner.flops import flops_per_token
from factory.schemas.blueprint import Blueprint

REPO = Path(__file__).resolve().parent.parent
SLICE = REPO / "benchmarks" / "blueprints" / "gpu_nano_slice.yaml"
PERIOD = "MEMEM*E"
"""Nano's pattern period: its first 35 layers are five of it."""


@pytest.fixture(scope="module")
def blueprints() -> tuple[Blueprint, Blueprint]:
    return factory.load_blueprint("nano"), factory.load_blueprint(SLICE)


def _cut(model: dict) -> dict:
    moe = {k: v for k, v in model["moe"].items() if k != "num_experts"}
    return {**{k: v for k, v in model.items() if k not in ("pattern", "max_seq_len")}, "moe": moe}


def test_the_slice_has_nanos_widths_and_routing(blueprints: tuple) -> None:
    nano, piece = (bp.model.model_dump() for bp in blueprints)
    assert _cut(piece) == _cut(nano)  # hidden, heads, Mamba, experts' widths, top-k, MTP...
    assert piece["moe"]["num_experts"] < nano["moe"]["num_experts"]
    assert piece["moe"]["top_k"] == nano["moe"]["top_k"]
    assert nano["mtp"] == piece["mtp"] and nano["moe"]["latent_size"] == piece["moe"]["latent_size"]


def test_the_slice_is_whole_periods_of_nanos_pattern(blueprints: tuple) -> None:
    nano, piece = (bp.model.pattern for bp in blueprints)
    assert nano.startswith(PERIOD * 5)
    assert piece == PERIOD * (len(piece) // len(PERIOD)) and len(piece) < len(nano)


def test_a_tokens_flops_per_layer_are_nanos(blueprints: tuple) -> None:
    nano, piece = blueprints
    seq = piece.data.seq_len
    for name, symbol in (("mamba", "M"), ("attention", "*"), ("moe", "E")):
        per_layer = [
            flops_per_token(bp.model, seq).by_layer_type[name] / bp.model.pattern.count(symbol)
            for bp in (nano, piece)
        ]
        # The router's scores, one per expert, are the only term fewer experts change: 0.4%.
        assert per_layer[0] == pytest.approx(per_layer[1], rel=5e-3), name


def test_the_plan_fits_the_slice_on_one_h100(blueprints: tuple) -> None:
    from factory.schemas.parallelism import GPU_SPECS

    plan = factory.plan(blueprints[1])
    assert plan.layout.world_size == 1 and blueprints[1].parallelism.gpu == "h100"
    assert plan.memory.total < 0.75 * GPU_SPECS["h100"].memory_bytes  # room for the runtime
