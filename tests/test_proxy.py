"""``factory.proxy``: CPU proxies keep the family's shape and pass every rule."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import factory
from factory.checks.registry import run_rules
from factory.cli.app import main
from factory.loading.blueprint import preset_names
from factory.proxy import derive_proxy, proxy_pattern
from factory.schemas.blueprint import Blueprint
from factory.schemas.program import resolve_program

PRESETS = preset_names()


@pytest.fixture(scope="module", params=PRESETS)
def pair(request: pytest.FixtureRequest) -> tuple[Blueprint, Blueprint]:
    source = factory.load_blueprint(request.param)
    return source, derive_proxy(source)


def test_every_preset_is_covered() -> None:
    assert set(PRESETS) >= {"nano", "super", "ultra", "nemotron_h_8b", "nemotron_nano_9b_v2"}


def test_proxy_passes_every_rule(pair: tuple[Blueprint, Blueprint]) -> None:
    _, proxy = pair
    assert [(r.name, f.severity, f.message) for r, f in run_rules(proxy)] == []


def test_proxy_keeps_every_layer_type(pair: tuple[Blueprint, Blueprint]) -> None:
    source, proxy = pair
    assert set(proxy.model.parsed_pattern.main) == set(source.model.parsed_pattern.main)
    assert proxy.model.parsed_pattern.symbols() | set(proxy.model.mtp_pattern) == (
        source.model.parsed_pattern.symbols() | set(source.model.mtp_pattern)
    )
    assert not proxy.model.parsed_pattern.has_pipes


def test_proxy_keeps_the_first_period(pair: tuple[Blueprint, Blueprint]) -> None:
    source, proxy = pair
    main = source.model.parsed_pattern.main
    first = main[: main.index("*") + 1] if "*" in main else main[:8]
    assert proxy.model.parsed_pattern.main.startswith(first)
    assert proxy.model.parsed_pattern.main[-1] == main[-1]


def test_proxy_keeps_the_gqa_ratio(pair: tuple[Blueprint, Blueprint]) -> None:
    source, proxy = pair
    src, dst = source.model.attention, proxy.model.attention
    assert src is not None and dst is not None
    assert dst.heads * src.kv_heads == src.heads * dst.kv_heads


def test_proxy_keeps_the_moe_ratios(pair: tuple[Blueprint, Blueprint]) -> None:
    source, proxy = pair
    src, dst = source.model.moe, proxy.model.moe
    if src is None:
        assert dst is None
        return
    assert dst is not None
    # top_k / num_experts kept to rounding, but never below two experts per token
    target = src.top_k * dst.num_experts / src.num_experts
    assert abs(dst.top_k - max(target, min(2, src.top_k))) <= 0.5
    assert bool(dst.shared_expert_intermediate_size) == bool(src.shared_expert_intermediate_size)
    if src.latent_size is None:
        assert dst.latent_size is None
    else:
        assert dst.latent_size is not None
        ratio = source.model.hidden_size / src.latent_size
        assert proxy.model.hidden_size / dst.latent_size == ratio


def test_proxy_keeps_mtp(pair: tuple[Blueprint, Blueprint]) -> None:
    source, proxy = pair
    assert proxy.model.mtp_depth == source.model.mtp_depth
    assert proxy.model.mtp_pattern == source.model.mtp_pattern
    assert proxy.model.mtp_stored_blocks == source.model.mtp_stored_blocks
    assert proxy.model.mtp == source.model.mtp
    assert proxy.model.parsed_pattern.mtp == source.model.parsed_pattern.mtp


def test_proxy_keeps_the_precision_policy(pair: tuple[Blueprint, Blueprint]) -> None:
    source, proxy = pair
    src, dst = source.precision, proxy.precision
    assert dst.model_dump(exclude={"high_precision"}) == src.model_dump(exclude={"high_precision"})
    assert list(dst.overrides.items()) == list(src.overrides.items())
    scale = proxy.model.num_layers / source.model.num_layers
    for field in ("first", "last"):
        kept, written = getattr(dst.high_precision, field), getattr(src.high_precision, field)
        assert abs(kept - written * scale) <= 0.5 or (written and kept == 1)
        assert bool(kept) == bool(written)


def test_proxy_is_small(pair: tuple[Blueprint, Blueprint]) -> None:
    source, proxy = pair
    assert factory.plan(proxy).params.total < 30_000_000
    assert proxy.model.hidden_size == 256
    assert proxy.parallelism.world_size == 1
    assert proxy.data.recipe == source.data.recipe
    assert proxy.meta.name == f"{source.meta.name}-proxy"
    assert proxy.meta.description.startswith("CPU proxy of ")


def test_proxy_is_deterministic_and_reapplies(pair: tuple[Blueprint, Blueprint]) -> None:
    source, proxy = pair
    assert derive_proxy(source) == proxy
    again = derive_proxy(proxy)
    assert [(r.name, f.message) for r, f in run_rules(again)] == []


def test_nano_worked_example() -> None:
    proxy = derive_proxy(factory.load_blueprint("nano"))
    model = proxy.model
    assert model.pattern == "MEMEM*EMEMEM*E"
    assert model.hidden_size == 256
    att, mamba, moe = model.attention, model.mamba, model.moe
    assert att is not None and mamba is not None and moe is not None
    assert (att.heads, att.kv_heads, att.head_dim) == (16, 1, 24)
    assert (mamba.heads, mamba.head_dim, mamba.groups, mamba.state_size) == (24, 16, 2, 16)
    assert (moe.num_experts, moe.top_k) == (32, 2)
    assert (moe.expert_intermediate_size, moe.shared_expert_intermediate_size) == (176, 352)
    assert moe.latent_size is None
    assert factory.plan(proxy).params.total == 22_871_792


def test_super_worked_example() -> None:
    proxy = derive_proxy(factory.load_blueprint("super"))
    model = proxy.model
    assert model.pattern == "MEMEMEM*EMEMEMEM*E"
    assert model.hidden_size == 256
    att, mamba, moe = model.attention, model.mamba, model.moe
    assert att is not None and mamba is not None and moe is not None
    assert (att.heads, att.kv_heads, att.head_dim) == (16, 1, 16)
    assert (mamba.heads, mamba.head_dim, mamba.groups, mamba.state_size) == (32, 16, 2, 16)
    assert (moe.num_experts, moe.top_k) == (32, 2)
    assert (moe.expert_intermediate_size, moe.shared_expert_intermediate_size) == (168, 336)
    assert moe.latent_size == 64
    assert (proxy.precision.high_precision.first, proxy.precision.high_precision.last) == (0, 3)
    assert factory.plan(proxy).params.total == 14_132_768


@pytest.mark.parametrize(
    ("main", "expected"),
    [
        ("MEMEM*EMEMEM*EMEMEM*EMEME", "MEMEM*EMEMEM*E"),
        ("M-M*-M", "M-M*-M"),  # one '*': the whole stack is two periods
        ("M-M-M-M-M-M-", "M-M-M-M-"),  # no '*': first eight layers
        ("MMMMMMMMMM-", "MMMMMMMM-"),  # the last layer's type is appended
        ("M*M*M*M-*E", "M*M*E-"),  # then each missing type once, in order of appearance
    ],
)
def test_proxy_pattern(main: str, expected: str) -> None:
    assert proxy_pattern(main) == expected


def test_plan_proxy_json(capsys: pytest.CaptureFixture[str]) -> None:
    # one stage's plan, then the program's: both name the proxy they plan
    assert main(["plan", "nano", "--stage", "phase1", "--proxy", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["name"] == "nano-proxy"
    assert doc["params"]["total"] == 22_871_792
    phase1 = resolve_program(factory.load_blueprint("nano")).stage("phase1").blueprint
    assert doc["params"] == factory.plan(derive_proxy(phase1)).to_dict()["params"]
    assert main(["plan", "nano", "--proxy", "--json"]) == 0
    program = json.loads(capsys.readouterr().out)
    assert program["name"] == "nano-proxy" and program["params"] == doc["params"]
    assert {stage["plan"]["name"] for stage in program["stages"]} == {"nano-proxy"}


SUPER_MAIN = factory.load_blueprint("super").model.parsed_pattern.main


@pytest.mark.parametrize(
    ("name", "overrides"),
    [
        # fp8 needs a 16-aligned Mamba in_proj: the heads round to a multiple of 16
        ("nano", ["precision.recipe=fp8", "precision.high_precision.layers=[10,11,40,51]"]),
        ("super", [f"model.pattern={SUPER_MAIN}/*E/*E", "model.mtp.depth=2"]),
        ("nano", ["model.moe.router.num_groups=8", "model.moe.router.group_top_k=4"]),
    ],
)
def test_proxy_of_edited_presets_is_clean(name: str, overrides: list[str]) -> None:
    source = factory.load_blueprint(name, overrides)
    proxy = derive_proxy(source)
    assert [(r.name, f.message) for r, f in run_rules(proxy)] == []
    assert proxy.model.parsed_pattern.mtp == source.model.parsed_pattern.mtp
    layers = proxy.precision.high_precision.layers
    assert layers == sorted(set(layers)) and all(0 <= i < proxy.model.num_layers for i in layers)


def test_proxy_imports_no_torch() -> None:
    script = (
        "import sys, factory\n"
        "from factory.proxy import derive_proxy\n"
        "derive_proxy(factory.load_blueprint('super'))\n"
        "assert 'torch' not in sys.modules\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
