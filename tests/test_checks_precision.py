"""factory.checks.precision_rules: each rule fires on a bad policy and stays silent on the base."""

from __future__ import annotations

import pytest
from blueprint_factory import assert_fires, findings, make

import factory
from factory.checks import RULES
from factory.loading.blueprint import preset_names
from factory.schemas import Blueprint
from factory.schemas.parallelism import GPU_SPECS
from factory.schemas.precision_recipes import SHIPPED

PRECISION_RULES = sorted(name for name in RULES if name.startswith("precision."))
HP = "precision.high_precision"

# (rule, overrides, blamed path, numbers the message must name, severity); the base has 9 layers.
CASES = [
    (
        "precision.high_precision_layers",
        {HP: {"first": 5, "last": 5}},
        HP,
        ("5 + 5 = 10", "9"),
        "error",
    ),
    (
        "precision.high_precision_layers",
        {HP: {"first": 4}, "parallelism.pp": 3},
        f"{HP}.first",
        ("first=4", "9 // 3 = 3"),
        "error",
    ),
    (
        "precision.high_precision_layers",
        {HP: {"last": 4}, "parallelism.pp": 3},
        f"{HP}.last",
        ("last=4", "9 // 3 = 3"),
        "error",
    ),
    (
        "precision.high_precision_layers",
        {HP: {"layers": [0, 9]}},
        f"{HP}.layers[1]",
        ("9", "[0, 9)"),
        "error",
    ),
    (
        "precision.delayed_scaling_first_last",
        {"precision.recipe": "fp8", "precision.fp8": {"scaling": "delayed"}, HP: {"last": 2}},
        "precision.fp8.scaling",
        ("first=0", "last=2"),
        "error",
    ),
    (
        "precision.override_globs",
        {"precision.overrides": {"*.mixer.outproj": "fp8"}},
        "precision.overrides['*.mixer.outproj']",
        ("26", "did you mean '*.mixer.out_proj'"),
        "error",
    ),
    (
        "precision.override_globs",
        {"precision.overrides": {"backbone.layers.9.*": "bf16"}},
        "precision.overrides['backbone.layers.9.*']",
        ("26",),
        "error",
    ),
    (
        "precision.override_globs",
        {"precision.overrides": {"lm_head": "bf16"}},
        "precision.overrides.lm_head",  # identifiers are not quoted
        ("'lm_head'", "never quantised"),
        "error",
    ),
    (
        "precision.hardware_support",
        {"precision.recipe": "nvfp4", "parallelism.gpu": "h100"},
        "precision.recipe",
        ("NVFP4", "h100"),
        "warning",
    ),
    (
        "precision.hardware_support",
        {"precision.overrides": {"*.mixer.out_proj": "mxfp8"}, "parallelism.gpu": "h200"},
        "precision.overrides",
        ("MXFP8", "h200"),
        "warning",
    ),
    (
        "precision.tp_blocks",  # Mamba's dt segment: 16 heads, 8 rows per rank
        {"precision.recipe": "nvfp4", "parallelism.tp": 2},
        "parallelism.tp",
        ("backbone.layers.*.mixer.in_proj.weight", "8 of the 16 rows", "16-element nvfp4"),
        "error",
    ),
    (
        "precision.tp_blocks",  # B and C: 2 groups x 16 states, 16 rows per rank
        {"precision.recipe": "mxfp8", "parallelism.tp": 2, "model.mamba.heads": 64},
        "parallelism.tp",
        ("in_proj.weight", "16 of the 32 rows of a packed segment", "32-element mxfp8"),
        "error",
    ),
    (
        "precision.tp_blocks",
        {
            "precision.overrides": {"*shared_experts*": "nvfp4"},
            "parallelism.tp": 2,
            "parallelism.sequence_parallel": True,
            "data.seq_len": 1040,
        },
        "data.seq_len",
        ("shared_experts.up_proj", "520 tokens", "16-token nvfp4", "multiple of 32"),
        "error",
    ),
    (
        "precision.switch_to_bf16_unused",
        {"precision.switch_to_bf16": {"after_fraction": 0.9}},
        "precision.switch_to_bf16",
        ("0.9",),
        "warning",
    ),
]


@pytest.mark.parametrize(("name", "overrides", "path", "numbers", "severity"), CASES)
def test_rule_fires(name, overrides, path, numbers, severity):
    assert_fires(name, make(**overrides), path, *numbers, severity=severity)


@pytest.mark.parametrize("name", PRECISION_RULES)
def test_rule_silent_on_base(name):
    assert findings(name, make()) == []


def test_every_precision_rule_has_a_firing_case():
    assert {case[0] for case in CASES} == set(PRECISION_RULES)


@pytest.mark.parametrize(
    "overrides",
    [
        {HP: {"first": 3, "last": 3}, "parallelism.pp": 3, "model.pattern": "M*M|E-M|*ME"},
        {"precision.recipe": "fp8", "precision.fp8": {"scaling": "delayed"}},
        {"precision.recipe": "fp8", HP: {"first": 1, "last": 1, "layers": [0, 8]}},
        {
            "parallelism.gpu": "gb200",
            "precision.recipe": "nvfp4",
            "precision.overrides": {
                "*.mixer.out_proj": "mxfp8",
                "backbone.layers.3.mixer.experts.*": "bf16",
                "*shared_experts*": "fp8",
            },
            "precision.switch_to_bf16": {"after_fraction": 0.9},
        },
        {
            "precision.overrides": {"*.q_proj": "fp8"},
            "precision.switch_to_bf16": {"after_fraction": 0.5},
        },
        {"model.pattern": "M*ME/*E", "precision.overrides": {"mtp.layers.0.eh_proj": "bf16"}},
        # TP over whole blocks: 32 Mamba heads (16 dt rows a rank), 512 tokens a rank.
        {
            "parallelism.gpu": "gb200",
            "precision.recipe": "nvfp4",
            "parallelism.tp": 2,
            "parallelism.sequence_parallel": True,
            "model.mamba.heads": 32,
        },
        # Per-tensor scales split anywhere: the amax is reduced over the ranks.
        {"precision.recipe": "fp8", "parallelism.tp": 2, "data.seq_len": 1040},
        # MoR's 1x8 blocks fit every split of the base at tp=2.
        {
            "precision.recipe": "mor",
            "precision.mor": {"granularity": "block", "block_size": 8},
            "parallelism.tp": 2,
        },
    ],
)
def test_valid_policies_are_silent(overrides):
    bp = make(**overrides)
    said = {name: findings(name, bp) for name in PRECISION_RULES}
    assert {name: f for name, f in said.items() if f} == {}


def test_every_recipe_runs_at_a_peak_some_gpu_lists():
    """A recipe's peak_format is a format of the GPU table (else no GPU runs it natively)."""
    formats = {fmt for spec in GPU_SPECS.values() for fmt in spec.dense_flops}
    assert {
        recipe.name: recipe.peak_format for recipe in SHIPPED if recipe.peak_format not in formats
    } == {}


def test_blackwell_formats_are_fine_on_blackwell():
    bp = make(**{"precision.recipe": "nvfp4", "parallelism.gpu": "b200"})
    assert findings("precision.hardware_support", bp) == []


def test_glob_on_a_router_gate_says_it_is_never_quantised():
    bp = make(**{"precision.overrides": {"*.mixer.gate": "fp8"}})
    finding = assert_fires("precision.override_globs", bp, "precision.overrides['*.mixer.gate']")
    assert "backbone.layers.3.mixer.gate" in finding.message


@pytest.mark.parametrize("name", preset_names())
def test_presets_split_whole_blocks(name: str) -> None:
    """Super and Ultra run NVFP4 (MXFP8 Mamba out_proj) at tp=2 with sequence parallelism."""
    assert findings("precision.tp_blocks", factory.load_blueprint(name)) == []


def test_super_at_tp_16_would_cut_mamba_dt_rows() -> None:
    data = factory.load_blueprint("super").model_dump(exclude_unset=True)
    data["parallelism"].update(tp=16, world_size=128)
    bp = Blueprint.model_validate(data)
    found = assert_fires("precision.tp_blocks", bp, "parallelism.tp", "8 of the 128 rows")
    assert "backbone.layers.*.mixer.in_proj.weight" in found.message
