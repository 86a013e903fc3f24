"""factory.checks.model_rules: each rule fires on a bad value and stays silent on the base."""

from __future__ import annotations

import pytest
from blueprint_factory import DELETE, assert_fires, findings, make

from factory.checks import RULES, model_rules, run_rules

MODEL_RULES = sorted(name for name in RULES if name.startswith("model."))

# (rule, overrides, blamed path, numbers or words the message must name, severity)
CASES = [
    ("model.layer_sections", {"model.moe": DELETE}, "model.moe", ("2", "'E'"), "error"),
    (
        "model.layer_sections",
        {"model.pattern": "M*M-M/*E", "model.moe": DELETE},
        "model.moe",
        ("1", "'E'"),
        "error",
    ),
    ("model.unused_sections", {"model.pattern": "M*M-"}, "model.moe", ("'E'",), "warning"),
    ("model.pattern_symbols", {"model.pattern": "M*XE"}, "model.pattern", ("'X'", "2"), "error"),
    (
        "model.pattern_symbols",
        {"model.pattern": "M*EG"},
        "model.pattern",
        ("'G'", "3", "Gated DeltaNet"),
        "error",
    ),
    (
        "model.attention_kv_heads",
        {"model.attention.kv_heads": 3},
        "model.attention.kv_heads",
        ("3", "8"),
        "error",
    ),
    ("model.mamba_groups", {"model.mamba.groups": 3}, "model.mamba.groups", ("3", "16"), "error"),
    (
        "model.mamba_in_proj_alignment",
        {"model.mamba.heads": 8, "model.mamba.head_dim": 32, "precision.recipe": "fp8"},
        "model.mamba.heads",
        ("584", "256", "fp8"),
        "error",
    ),
    (
        "model.mamba_in_proj_alignment",
        {"model.mamba.heads": 8, "model.mamba.head_dim": 32, "precision.overrides": {"*": "mor"}},
        "model.mamba.heads",
        ("584", "mor"),
        "error",
    ),
    ("model.moe_top_k", {"model.moe.top_k": 9}, "model.moe.top_k", ("9", "8"), "error"),
    (
        "model.moe_latent_size",
        {"model.moe.latent_size": 256},
        "model.moe.latent_size",
        ("256",),
        "error",
    ),
    (
        "model.moe_router_groups",
        {"model.moe.router": {"num_groups": 3}},
        "model.moe.router.num_groups",
        ("3", "8"),
        "error",
    ),
    (
        "model.moe_router_groups",
        {"model.moe.router": {"num_groups": 2, "group_top_k": 3}},
        "model.moe.router.group_top_k",
        ("3", "2"),
        "error",
    ),
    (
        "model.moe_router_groups",
        {"model.moe.router": {"num_groups": 4, "group_top_k": 1}, "model.moe.top_k": 4},
        "model.moe.router.group_top_k",
        ("1*(8/4) = 2", "4"),
        "error",
    ),
    (
        "model.mtp_segments",
        {"model.pattern": "M*ME/*E/*-"},
        "model.pattern",
        ("'*E'", "'*-'"),
        "error",
    ),
    (
        "model.mtp_consistent",
        {"model.pattern": "M*ME/*E/*E", "model.mtp": {"depth": 3}},
        "model.mtp.depth",
        ("3", "2"),
        "error",
    ),
    (
        "model.mtp_consistent",
        {"model.pattern": "M*ME/*E", "model.mtp": {"pattern": "ME"}},
        "model.mtp.pattern",
        ("'ME'", "'*E'"),
        "error",
    ),
    (
        "model.mtp_pattern",
        {"model.mtp": {"pattern": "*E|E"}},
        "model.mtp.pattern",
        ("'|'",),
        "error",
    ),
    (
        "model.mtp_pattern",
        {"model.mtp": {"pattern": "*/E"}},
        "model.mtp.pattern",
        ("'/'",),
        "error",
    ),
    ("model.mtp_pattern", {"model.mtp": {"pattern": "*X"}}, "model.mtp.pattern", ("'X'",), "error"),
    ("model.rope_unused", {"model.rope_base": 5e5}, "model.rope_base", ("500000",), "warning"),
]


@pytest.mark.parametrize(("name", "overrides", "path", "numbers", "severity"), CASES)
def test_rule_fires(name, overrides, path, numbers, severity):
    assert_fires(name, make(**overrides), path, *numbers, severity=severity)


@pytest.mark.parametrize("name", MODEL_RULES)
def test_rule_silent_on_base(name):
    assert findings(name, make()) == []


def test_every_model_rule_has_a_firing_case():
    assert {case[0] for case in CASES} == set(MODEL_RULES)


def test_base_is_clean_under_every_rule():
    assert run_rules(make()) == []


def test_alignment_is_silent_in_bf16():
    """Megatron only asserts the 16-alignment for quantised GEMMs."""
    bp = make(**{"model.mamba.heads": 8, "model.mamba.head_dim": 32})
    assert findings("model.mamba_in_proj_alignment", bp) == []


def test_aligned_mamba_passes_under_nvfp4():
    assert findings("model.mamba_in_proj_alignment", make(**{"precision.recipe": "nvfp4"})) == []


def test_mtp_section_with_defaults_agrees_with_slash_pattern():
    """Only values written in model.mtp are compared: `repeated` alone is consistent."""
    bp = make(**{"model.pattern": "M*ME/*E/*E", "model.mtp": {"repeated": True}})
    assert findings("model.mtp_consistent", bp) == []


def test_mtp_section_symbols_need_sections():
    bp = make(**{"model.pattern": "M*M", "model.mtp": {"pattern": "-"}, "model.mlp": DELETE})
    assert_fires("model.layer_sections", bp, "model.mlp", "'-'")


def test_rope_settings_are_fine_with_rope():
    bp = make(**{"model.position_embedding": "rope", "model.rope_base": 5e5})
    assert findings("model.rope_unused", bp) == []


def test_used_symbols_include_mtp():
    bp = make(**{"model.pattern": "MM/*E"})
    assert model_rules.used_symbols(bp.model) == {"M", "*", "E"}
