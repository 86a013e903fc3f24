"""factory.checks.runtime_rules: what factory's runtime cannot run is said once, as rules,
and ``factory validate``, the launch, the proxy's layout and the layout search all say it
alike."""

from __future__ import annotations

from pathlib import Path

import pytest
from blueprint_factory import assert_fires, findings, make
from preset_stages import allowed_warnings, stage_alone

import factory
from factory.checks import RULES
from factory.checks.runtime_rules import (
    RUNTIME_RULES,
    runtime_refusals,
    transformer_engine_problem,
)
from factory.checks.validate import load
from factory.errors import BlueprintError
from factory.jobs.launch import LaunchRefused, check_launch
from factory.layout_search import search_layouts
from factory.proxy_layout import derive_proxy_layout
from factory.schemas.blueprint import Blueprint
from factory.schemas.program import resolve_program

PRESETS = ["nano", "super", "ultra", "nemotron_h_8b", "nemotron_nano_9b_v2"]
MODULES = "parallelism.modules"

# (rule, overrides of the rule tests' base, blamed path, what the message names, severity)
CASES = [
    (
        "runtime.moe_sequence_parallel",
        {"parallelism.tp": 2},
        "parallelism.sequence_parallel",
        ("tp=2", "MoE", "--set parallelism.sequence_parallel=true"),
        "error",
    ),
    (
        "runtime.context_across_stages",
        {"parallelism.cp": 2, "parallelism.pp": 2},
        "parallelism.cp",
        ("cp=2", "pp=2", "--set parallelism.pp=1"),
        "warning",
    ),
    (
        "runtime.module_layouts",
        {MODULES: {"vision": {"num_ranks": 8}, "language": {"num_ranks": 8}}},
        MODULES,
        ("vision, language",),
        "warning",
    ),
    (
        "runtime.eval_pipeline",
        {"parallelism.pp": 2, "training.eval": {"interval": 10}},
        "training.eval",
        ("pp=2", "--set parallelism.pp=1", "factory eval"),
        "warning",
    ),
]


@pytest.mark.parametrize(("name", "overrides", "path", "named", "severity"), CASES)
def test_rule_fires(name, overrides, path, named, severity) -> None:
    assert_fires(name, make(**overrides), path, *named, severity=severity)


def test_every_runtime_rule_has_a_firing_case() -> None:
    assert {case[0] for case in CASES} == set(RUNTIME_RULES)
    assert set(RUNTIME_RULES) == {name for name in RULES if name.startswith("runtime.")}


def test_moe_under_tp_needs_sequence_parallelism_whatever_ep() -> None:
    """Megatron's config asks for SP only with TP and EP, but its MoE layer refuses to train
    under TP without SP at EP 1 too, as factory's tensor parallelism does; a dense model
    runs TP without SP."""
    assert findings("runtime.moe_sequence_parallel", make(**{"parallelism.tp": 2}))
    both = make(**{"parallelism.tp": 2, "parallelism.ep": 2})
    assert findings("runtime.moe_sequence_parallel", both)
    dense = make(**{"parallelism.tp": 2, "model.pattern": "M*M-M*M-"})
    assert findings("runtime.moe_sequence_parallel", dense) == []


@pytest.mark.parametrize("preset", PRESETS)
def test_presets_are_silent(preset: str) -> None:
    """Every stage of a preset runs on factory's runtime, but for the published layouts that
    the allow-list names (tests/preset_stages.py): those stages are refused, by those rules."""
    allowed = allowed_warnings(preset)
    for stage in resolve_program(factory.load_blueprint(preset)):
        bp = stage.blueprint
        expected = [name for name in RUNTIME_RULES if name in allowed.get(stage.name, ())]
        assert [name for name, _ in runtime_refusals(bp)] == expected, stage.name
        assert [name for name in RUNTIME_RULES if findings(name, bp)] == expected, stage.name


def test_validate_the_launch_the_proxy_and_the_search_say_the_same(tmp_path: Path) -> None:
    """A layout the search keeps (Megatron runs it) with CP across pipeline stages: the
    search and validate warn with the rule, the launch refuses with its message and the
    proxy's layout leaves pipeline parallelism out. On Nano's pretraining (phase 1 alone)."""
    name = "runtime.context_across_stages"
    nano = stage_alone("nano", "phase1", tmp_path)
    results = search_layouts(factory.load_blueprint(nano), 8, "h100")
    found = [r for r in results if any(rule == name for rule, _ in r.warnings)]
    assert found, "the search keeps no layout with CP across pipeline stages"
    result = found[0]
    searched = next(f for rule, f in result.warnings if rule == name)
    assert (result.blueprint.parallelism.cp, result.blueprint.parallelism.pp) == (2, 2)

    validated = [d for d in load(nano, result.overrides).diagnostics if d.rule == name]
    assert [(d.path, d.message, d.severity) for d in validated] == [
        (searched.path, searched.message, "warning")
    ]

    with pytest.raises(LaunchRefused) as refused:
        check_launch(result.blueprint, 8)
    assert (refused.value.rule, refused.value.path, str(refused.value)) == (
        name,
        searched.path,
        searched.message,
    )

    proxy, changes = derive_proxy_layout(result.blueprint, 4)
    assert (proxy.parallelism.cp, proxy.parallelism.pp) == (2, 1) and "pp 2 -> 1" in changes
    check_launch(proxy, 4)


def test_an_error_rule_refuses_validate_and_the_launch_alike(tmp_path: Path) -> None:
    """MoE under TP without SP: validate's error and the launch's refusal are one finding;
    the launch also refuses a blueprint that never went through validate. On Nano's
    pretraining (phase 1 alone)."""
    name = "runtime.moe_sequence_parallel"
    nano = stage_alone("nano", "phase1", tmp_path)
    with pytest.raises(BlueprintError) as invalid:
        load(nano, ["parallelism.sequence_parallel=false"])
    said = [d for d in invalid.value.diagnostics if d.rule == name]
    assert len(said) == 1
    data = factory.load_blueprint(nano).model_dump(exclude_unset=True)
    data["parallelism"]["sequence_parallel"] = False
    unchecked = Blueprint.model_validate(data)
    with pytest.raises(LaunchRefused) as refused:
        check_launch(unchecked, unchecked.parallelism.world_size)
    assert (refused.value.rule, refused.value.path, str(refused.value)) == (
        name,
        said[0].path,
        said[0].message,
    )


def test_transformer_engine_under_tp_is_refused_only_for_the_te_backend() -> None:
    """Not a validate rule (a run picks the backend), but the same runtime rules say it."""
    sup = factory.load_blueprint("super")
    world = sup.parallelism.world_size
    check_launch(sup, world)
    check_launch(sup, world, "emulate")
    with pytest.raises(LaunchRefused) as refused:
        check_launch(sup, world, "te")
    assert refused.value.rule is None and refused.value.path == "parallelism.tp"
    assert str(refused.value) == transformer_engine_problem(sup)
    assert "--precision emulate" in str(refused.value)
