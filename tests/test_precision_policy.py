"""The precision policy table: Super and Ultra reproduce the published NVFP4 split
(``docs/precision.md``, 'Published Super and Ultra policy')."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from preset_stages import stage_alone

import factory
from factory.precision.policy import flops_share, resolve_policy


@pytest.mark.parametrize(("name", "last"), [("super", 14), ("ultra", 16)])
def test_published_split(name: str, last: int) -> None:
    bp = factory.load_blueprint(name)
    layers = bp.model.num_layers
    for row in resolve_policy(bp):
        index = row.layer
        leaf = row.name.rsplit(".", 1)[-1]
        if row.name.startswith("mtp."):
            expected = "bf16"  # MTP layers
        elif index >= layers - last:
            expected = "bf16"  # the final ~15% of the network
        elif leaf in ("q_proj", "k_proj", "v_proj", "o_proj"):
            expected = "bf16"  # QKV and attention output projections
        elif leaf in ("fc1_latent_proj", "fc2_latent_proj"):
            expected = "bf16"  # MoE latent projections
        elif leaf == "out_proj":
            expected = "mxfp8"  # the Mamba output projection
        else:
            expected = "nvfp4"
        assert row.recipe == expected, (row.name, row.reason)


def test_high_precision_beats_overrides_and_later_globs_win(tmp_path: Path) -> None:
    # Nano's pretraining (phase 1 alone): the later stages' own tp=8 leaves half an MXFP8
    # block per rank too.
    bp = factory.load_blueprint(
        stage_alone("nano", "phase1", tmp_path),
        [
            "precision.recipe=fp8",
            "precision.high_precision.first=1",
            "precision.overrides={'*.mixer.in_proj': mxfp8, 'backbone.layers.2.*': nvfp4}",
            # Nano's tp=4 would give each rank 16 of the 64 dt rows of in_proj, half an MXFP8
            # block (precision.tp_blocks).
            "parallelism.tp=2",
        ],
    )
    table = {row.name: row for row in resolve_policy(bp)}
    assert table["backbone.layers.0.mixer.in_proj"].recipe == "bf16"
    assert table["backbone.layers.0.mixer.in_proj"].reason == "high_precision"
    assert table["backbone.layers.2.mixer.in_proj"].recipe == "nvfp4"  # the later glob wins
    assert table["backbone.layers.4.mixer.in_proj"].recipe == "mxfp8"
    assert table["backbone.layers.5.mixer.q_proj"].recipe == "fp8"


def test_flops_shares_sum_to_one_and_count_experts_top_k_times() -> None:
    bp = factory.load_blueprint("nano")
    table = resolve_policy(bp)
    assert sum(flops_share(table).values()) == pytest.approx(1.0)
    up = next(r for r in table if r.name == "backbone.layers.1.mixer.experts.up_proj")
    assert up.flops_per_token == 2 * 2688 * 1856 * 6


def test_cli_prints_the_table(cli) -> None:
    status, out, err = cli("plan", "super", "--stage", "phase1", "--precision", "--json")
    assert status == 0, err
    doc = json.loads(out)
    assert set(doc["flops_share"]) == {"bf16", "mxfp8", "nvfp4"}
    assert doc["modules"][0]["module"] == "backbone.layers.0.mixer.in_proj"
    assert len(doc["gemm_paths"]) == 2  # one line per quantizing recipe: nvfp4, mxfp8
    assert all("emulated" in line for line in doc["gemm_paths"])
