"""The presets' plans against the published numbers (``docs/architecture.md``, 'Parameter counts';
``docs/flops.md``, 'Reference values')."""

from __future__ import annotations

import pytest
from preset_stages import allowed_warnings, stage_warnings

import factory

# (main model, with MTP, active), docs/architecture.md 'Parameter counts'; None: not checked here.
EXACT = {
    "nano": (31_577_940_288, 31_577_940_288, 3_580_076_352),
    "super": (120_668_707_840, 123_611_033_088, 12_770_237_440),
    "ultra": (549_308_993_536, None, None),
    "nemotron_h_8b": (8_100_852_736, 8_100_852_736, 8_100_852_736),
    "nemotron_nano_9b_v2": (8_888_227_328, 8_888_227_328, 8_888_227_328),
}


@pytest.mark.parametrize("name", sorted(EXACT))
def test_parameter_counts_are_exact(name: str) -> None:
    main, with_mtp, active = EXACT[name]
    params = factory.plan(factory.load_blueprint(name)).params
    assert params.total_main == main
    if with_mtp is not None:
        assert params.total == with_mtp
    if active is not None:
        assert params.active == active
    assert (
        sum(row["total"] for row in params.by_layer_type.values())
        + params.embedding
        + (params.head + params.final_norm)
        == params.total_main
    )


def test_ultra_active_matches_the_exact_count() -> None:
    # docs/architecture.md, 'Parameter counts': 56,058,843,136 with embedding and head (no MTP)
    assert factory.plan(factory.load_blueprint("ultra")).params.active == 56_058_843_136


@pytest.mark.parametrize(
    ("name", "overrides", "gflops"),
    [
        ("nano", ["data.seq_len=8192"], 22.28),
        ("nano", ["data.seq_len=4096"], 21.67),
        ("super", [], 84.73),  # two repeated MTP depths, seq 8192
        ("super", ["data.seq_len=4096"], 83.72),
    ],
)
def test_megatron_flops_match_the_reference_values(
    name: str, overrides: list[str], gflops: float
) -> None:
    flops = factory.plan(factory.load_blueprint(name, overrides)).flops_per_token
    assert round(flops.megatron / 1e9, 2) == gflops


def test_plan_json_has_the_promised_keys() -> None:
    doc = factory.plan(factory.load_blueprint("super")).to_dict()
    params = doc["params"]
    assert {"total", "total_main", "active", "by_layer_type"} <= params.keys()
    assert set(params["by_layer_type"]) == {"mamba", "attention", "moe"}
    assert {"megatron", "exact"} <= doc["flops_per_token"].keys()
    memory = doc["memory_per_rank_bytes"]
    assert {"distributed_optimizer", "no_distributed_optimizer"} <= set(
        memory["weights_grads_optimizer"]
    )
    assert set(memory["activations"]["per_layer_type"]) == {"mamba", "attention", "moe"}
    assert memory["total"] > memory["activations"]["total"] > 0
    layout = doc["layout"]
    assert (layout["tp"], layout["dp"], layout["ep"], layout["edp"]) == (2, 32, 64, 1)


def test_ultra_layout_places_its_pipeline_stages() -> None:
    layout = factory.plan(factory.load_blueprint("ultra")).layout
    assert (layout.pp, layout.vpp, layout.dp, layout.edp) == (4, 1, 64, 2)
    assert [len(layout.layers_on_rank(r)) for r in range(4)] == [27, 27, 27, 27]


def test_distributed_optimizer_shrinks_the_peak_rank() -> None:
    bp = factory.load_blueprint("nano")
    memory = factory.plan(bp).memory.weights_grads_optimizer
    assert memory["distributed_optimizer"] < memory["no_distributed_optimizer"]


def test_presets_fit_their_gpus_and_validate_without_warnings() -> None:
    """Every stage of every preset fits its GPUs and validates without a warning, but for
    the allow-listed facts of the published layouts (tests/preset_stages.py), which must
    still fire where listed."""
    from factory.checks.validate import load
    from factory.loading.blueprint import preset_names

    for name in preset_names():
        allowed = allowed_warnings(name)
        assert stage_warnings(name) == allowed, name
        said = {d.rule for d in load(name).warnings}
        assert said == set().union(*allowed.values()), name
