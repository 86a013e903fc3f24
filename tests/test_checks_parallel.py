"""factory.checks.parallel_rules: each rule fires on a bad layout and stays silent on the base.

The base is W=8 with every degree 1, a 9-layer pattern without pipes,
8 attention heads / 2 KV heads, 16 Mamba heads / 2 groups and 8 experts.
"""

from __future__ import annotations

import pytest
from blueprint_factory import DELETE, assert_fires, findings, make

from factory.checks import RULES

PARALLEL_RULES = sorted(name for name in RULES if name.startswith("parallelism."))
FOUR_STAGES = "M*|ME|-M|*ME"
MODULES = "parallelism.modules"

# (rule, overrides, blamed path, numbers the message must name, severity)
CASES = [
    (
        "parallelism.world_size",
        {"parallelism.tp": 3},
        "parallelism.world_size",
        ("8", "3"),
        "error",
    ),
    ("parallelism.world_size", {"parallelism.dp": 4}, "parallelism.dp", ("dp=4", "8"), "error"),
    ("parallelism.expert_grid", {"parallelism.etp": 3}, "parallelism.ep", ("8", "3*1*1"), "error"),
    ("parallelism.tp_attention", {"parallelism.tp": 3}, "parallelism.tp", ("tp=3", "8"), "error"),
    (
        "parallelism.tp_attention",
        {"model.attention.heads": 24, "model.attention.kv_heads": 3, "parallelism.tp": 2},
        "parallelism.tp",
        ("(3)", "tp=2"),
        "error",
    ),
    ("parallelism.tp_mamba", {"parallelism.tp": 3}, "parallelism.tp", ("tp=3", "16"), "error"),
    ("parallelism.tp_mamba", {"parallelism.tp": 4}, "parallelism.tp", ("tp=4", "(2)"), "error"),
    ("parallelism.cp_mamba", {"parallelism.cp": 32}, "parallelism.cp", ("16", "cp=32"), "error"),
    (
        "parallelism.cp_mamba",
        {"model.mamba.heads": 48, "model.mamba.groups": 6, "parallelism.cp": 4},
        "parallelism.cp",
        ("6", "cp=4"),
        "error",
    ),
    ("parallelism.ep_experts", {"parallelism.ep": 3}, "parallelism.ep", ("ep=3", "8"), "error"),
    (
        "parallelism.ep_experts",
        {"parallelism.ep": 2, "model.moe": DELETE, "model.pattern": "M*M-"},
        "parallelism.ep",
        ("ep=2",),
        "error",
    ),
    (
        "parallelism.etp_experts",
        {"parallelism.etp": 8, "model.moe.expert_intermediate_size": 100},
        "parallelism.etp",
        ("etp=8", "(100)"),
        "error",
    ),
    (
        "parallelism.etp_experts",
        {"parallelism.tp": 8, "model.moe.expert_intermediate_size": 100},
        "parallelism.etp",
        ("etp=8", "(100)", "defaults to tp"),
        "error",
    ),
    (
        "parallelism.pipeline",
        {"model.pattern": "M*M|E-M|*ME", "parallelism.pp": 2},
        "parallelism.pp",
        ("3", "pp=2"),
        "error",
    ),
    (
        "parallelism.pipeline",
        {"model.pattern": FOUR_STAGES, "parallelism.pp": 2, "parallelism.vpp": 3},
        "parallelism.vpp",
        ("vpp=3", "4", "pp=2"),
        "error",
    ),
    (
        "parallelism.pipeline",
        {"parallelism.pp": 3, "parallelism.vpp": 2},
        "parallelism.vpp",
        ("vpp=2",),
        "error",
    ),
    ("parallelism.pipeline", {"parallelism.pp": 2}, "parallelism.pp", ("pp=2", "9"), "error"),
    ("parallelism.pipeline", {"parallelism.pp": 3}, "model.pattern", ("pp=3", "9"), "warning"),
    (
        "parallelism.pipeline",
        {"model.pattern": "M*ME|-M*ME"},
        "parallelism.pp",
        ("vpp=2", "pp=1"),
        "error",
    ),
    (
        "parallelism.interleaved_microbatches",
        {"model.pattern": FOUR_STAGES, "parallelism.pp": 2, "parallelism.global_batch_size": 12},
        "parallelism.global_batch_size",
        ("12", "= 3 microbatches", "pp=2"),
        "error",
    ),
    (
        "parallelism.interleaved_microbatches",
        {"model.pattern": FOUR_STAGES, "parallelism.pp": 2, "parallelism.global_batch_size": 4},
        "parallelism.global_batch_size",
        ("= 1 microbatches", "pp=2"),
        "error",
    ),
    ("parallelism.seq_len", {"parallelism.cp": 3}, "data.seq_len", ("1024", "6"), "error"),
    (
        "parallelism.seq_len",
        {"data.seq_len": 1020, "parallelism.tp": 8, "parallelism.sequence_parallel": True},
        "data.seq_len",
        ("1020", "tp=8"),
        "error",
    ),
    (
        "parallelism.global_batch",
        {"parallelism.global_batch_size": 12},
        "parallelism.global_batch_size",
        ("(12)", "(1)", "(8)"),
        "error",
    ),
    (
        "parallelism.sequence_parallel",
        {"parallelism.sequence_parallel": True},
        "parallelism.sequence_parallel",
        ("tp=1",),
        "warning",
    ),
    (
        "parallelism.distributed_optimizer_instances",
        {"parallelism.distributed_optimizer_instances": 3},
        "parallelism.distributed_optimizer_instances",
        ("8", "3"),
        "error",
    ),
    (
        "parallelism.flex_dispatcher",
        {"parallelism.moe_dispatcher": "flex"},
        "parallelism.moe_dispatcher",
        ("1*1",),
        "error",
    ),
    (
        "parallelism.nvlink_domain",
        {"parallelism.ep": 16, "parallelism.world_size": 16},
        "parallelism.ep",
        ("16", "(8 GPUs)"),
        "warning",
    ),
    ("parallelism.nvlink_domain", {"parallelism.tp": 16}, "parallelism.tp", ("16", "8"), "warning"),
    (
        "parallelism.modules",
        {MODULES: {"vision": {"num_ranks": 8, "tp": 3}}},
        "parallelism.modules.vision.num_ranks",
        ("8", "3*1*1"),
        "error",
    ),
    (
        "parallelism.modules",
        {MODULES: {"language": {"num_ranks": 8, "ep": 3}}},
        "parallelism.modules.language.ep",
        ("ep=3", "8"),
        "error",
    ),
    (
        "parallelism.modules",
        {MODULES: {"vision": {"num_ranks": 4, "rank_offset": 6}}},
        "parallelism.modules.vision.rank_offset",
        ("[6, 10)", "[0, 8)"),
        "error",
    ),
    (
        "parallelism.modules",
        {MODULES: {"v": {"num_ranks": 2}, "language": {"num_ranks": 4, "rank_offset": 4}}},
        MODULES,
        ("[2, 4)",),
        "error",
    ),
    (
        "parallelism.modules",
        {MODULES: {"v": {"num_ranks": 4}, "language": {"num_ranks": 4, "rank_offset": 2}}},
        MODULES,
        ("[2, 6)", "4"),
        "error",
    ),
    (
        "parallelism.modules",
        {MODULES: {"v": {"num_ranks": 4}, "language": {"num_ranks": 4}}},
        MODULES,
        ("[0, 4)", "[0, 8)"),
        "error",
    ),
    (
        "parallelism.moe_bias_etp",
        {"model.mlp.bias": True, "parallelism.etp": 2},
        "parallelism.etp",
        ("etp=2", "model.mlp.bias"),
        "error",
    ),
]


@pytest.mark.parametrize(("name", "overrides", "path", "numbers", "severity"), CASES)
def test_rule_fires(name, overrides, path, numbers, severity):
    assert_fires(name, make(**overrides), path, *numbers, severity=severity)


@pytest.mark.parametrize("name", PARALLEL_RULES)
def test_rule_silent_on_base(name):
    assert findings(name, make()) == []


def test_every_parallel_rule_has_a_firing_case():
    assert {case[0] for case in CASES} == set(PARALLEL_RULES)


@pytest.mark.parametrize(
    "overrides",
    [
        # Nano-like folding: TP2 for dense layers, EP8 with ETP1 for experts, SP on.
        {"parallelism.tp": 2, "parallelism.ep": 8, "parallelism.etp": 1},
        # Megatron's default: ETP follows TP (2), the 128-wide experts split in two, EP 4.
        {"parallelism.tp": 2, "parallelism.ep": 4},
        # Four '|' segments on pp=2 give vpp=2; 4 microbatches per step.
        {"model.pattern": FOUR_STAGES, "parallelism.pp": 2, "parallelism.vpp": 2},
        {"parallelism.cp": 2, "model.mamba.groups": 4},
        {MODULES: {"v": {"num_ranks": 4, "tp": 2}, "language": {"num_ranks": 4, "rank_offset": 4}}},
        {MODULES: {"v": {"num_ranks": 8}, "language": {"num_ranks": 8, "ep": 8}}},
        {"parallelism.moe_dispatcher": "flex", "parallelism.ep": 2},
        # EP64 fits in one NVL72 rack.
        {
            "parallelism.gpu": "gb200",
            "parallelism.world_size": 64,
            "parallelism.global_batch_size": 64,
            "parallelism.ep": 64,
            "model.moe.num_experts": 64,
        },
    ],
)
def test_valid_layouts_are_silent(overrides):
    if "parallelism.tp" in overrides:
        overrides = {**overrides, "parallelism.sequence_parallel": True}
    bp = make(**overrides)
    said = {name: findings(name, bp) for name in PARALLEL_RULES}
    assert {name: f for name, f in said.items() if f} == {}


def test_kv_heads_may_be_replicated_when_tp_exceeds_them():
    """TP=4 over 2 KV heads replicates each KV head twice: allowed."""
    assert findings("parallelism.tp_attention", make(**{"parallelism.tp": 4})) == []


def test_language_module_etp_must_divide_the_expert_width():
    bp = make(
        **{
            MODULES: {"language": {"num_ranks": 8, "etp": 8}},
            "model.moe.expert_intermediate_size": 100,
        }
    )
    assert_fires("parallelism.modules", bp, "parallelism.modules.language.etp", "etp=8", "(100)")


def test_etp_without_routed_experts_splits_nothing():
    """A dense model's etp (it defaults to tp) is never checked: Megatron ignores it."""
    bp = make(**{"parallelism.etp": 8, "model.moe": DELETE, "model.pattern": "M*M-"})
    assert findings("parallelism.etp_experts", bp) == []


def test_language_module_ep_needs_moe():
    bp = make(
        **{
            MODULES: {"language": {"num_ranks": 8, "ep": 2}},
            "model.moe": DELETE,
            "model.pattern": "M*M-",
        }
    )
    assert_fires("parallelism.modules", bp, "parallelism.modules.language.ep", "ep=2")


def test_module_names_that_are_not_identifiers_are_quoted():
    bp = make(**{MODULES: {"vision.enc": {"num_ranks": 8, "tp": 3}}})
    assert_fires("parallelism.modules", bp, "parallelism.modules['vision.enc'].num_ranks", "3")


def test_rules_do_not_crash_on_an_impossible_world():
    """Every derived size is guarded, so a non-dividing world only yields findings."""
    bp = make(**{"parallelism.world_size": 7, "parallelism.tp": 2, "parallelism.pp": 2})
    for name in PARALLEL_RULES:
        findings(name, bp)
