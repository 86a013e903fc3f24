"""factory export megatron: the installed Megatron-Bridge builds and validates every preset.

For each preset, recipe.py's ConfigContainer is constructed with the installed Bridge release
(0.3.1 in CI: the newest on Python 3.11, installed with --no-deps) and Bridge's own validate()
runs with WORLD_SIZE set to the layout's. Blueprints with multi-token prediction need fields
0.3.x lacks; there recipe.py raises one error naming them and the release that has them.
Transformer Engine does not install without CUDA: ``bridge_te_stub`` stands in for it, in a
child process, and the test asserts nothing on this path called it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import pytest
from conftest import PRESETS, REPO
from megatron_exports import export_preset

import factory
from factory.exports.megatron_fields import PROVIDER_FIELDS_SINCE

NAMES = sorted(p.stem for p in PRESETS.glob("*.yaml"))
UNFIT = "nano at WORLD_SIZE=3"
MTP_FIELDS = {
    "mtp_hybrid_override_pattern": "model.mtp.pattern",
    "mtp_use_repeated_layer": "model.mtp.repeated",
    "keep_mtp_spec_in_bf16": "precision.overrides (MTP layers)",
}


def _installed(package: str) -> tuple[int, ...] | None:
    try:
        return tuple(int(part) for part in version(package).split(".")[:3])
    except PackageNotFoundError:
        return None


def _too_old_for_mtp() -> dict[str, str]:
    """Package -> release it needs, for each MTP field the installed releases lack."""
    return {
        package: release
        for package, release in PROVIDER_FIELDS_SINCE.values()
        if _installed(package) < tuple(int(part) for part in release.split("."))
    }


pytestmark = pytest.mark.skipif(
    _installed("megatron-bridge") is None,
    reason="megatron-bridge is not installed (README: pip install --no-deps megatron-bridge)",
)


@pytest.fixture(scope="module")
def bridge_report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every preset's recipes (one per stage for a program) exported and run through Bridge in
    one child process (one Bridge import); ``labels`` maps each preset to its recipes'."""
    out = tmp_path_factory.mktemp("bridge")
    jobs, labels, model_fields = [], {}, {}
    for name in NAMES:
        exported = export_preset(name, out / name)
        labels[name] = [recipe.label for recipe in exported]
        for recipe in exported:
            model_fields[recipe.label] = sorted(recipe.shape.fields["model"])
            world = recipe.blueprint.parallelism.world_size
            jobs.append([recipe.label, str(recipe.recipe), world])
        if name == "nano":  # a world size the layout (tp=4, ep=8) cannot divide
            jobs.append([UNFIT, str(exported[0].recipe), 3])
        if name == "super":
            script = exported[0].recipe
    # Run as a script only where it stops at the config: a newer Bridge would start training.
    as_script = [str(script)] if _too_old_for_mtp() else []
    done = subprocess.run(
        [sys.executable, str(REPO / "tests" / "bridge_validate.py"), json.dumps(jobs), *as_script],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO / "tests",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.splitlines()[-1])
    return report | {"script": str(script), "labels": labels, "model_fields": model_fields}


def _needs_mtp(name: str) -> bool:
    return bool(factory.load_blueprint(name, []).model.mtp_depth)


@pytest.mark.parametrize("name", NAMES)
def test_bridge_validates_the_recipe_or_names_the_release_it_needs(name, bridge_report):
    """Every preset validates, except that under Bridge 0.3.x (megatron-core 0.16.1) super and
    ultra (multi-token prediction) get one ImportError naming each missing field, the
    blueprint path that asks for it and the first releases that have them."""
    fields = bridge_report["model_fields"]
    for label in bridge_report["labels"][name]:
        result = bridge_report["results"][label]
        if not (_needs_mtp(name) and _too_old_for_mtp()):
            assert result == "ok", label
            continue
        installed = f"Megatron-Bridge {version('megatron-bridge')} with megatron-core "
        assert result.startswith(f"ImportError: {installed}{version('megatron-core')} has no ")
        for field, where in MTP_FIELDS.items():  # each the recipe sets (a BF16 stage: 2)
            if field in fields[label]:
                assert f"{field} ({where})" in result
        wants = " and ".join(
            f"{package} >= {release}" for package, release in _too_old_for_mtp().items()
        )
        assert result.endswith(f"which this blueprint needs; install {wants}")


def test_run_as_a_script_an_older_bridge_exits_with_one_line(bridge_report: dict[str, Any]):
    """``python recipe.py`` for super under Bridge 0.3.x: SystemExit (status 1) with the recipe's
    path and the same message, on one line, before any training import."""
    if not _too_old_for_mtp():
        pytest.skip(f"super runs with Megatron-Bridge {bridge_report['bridge']}")
    first = bridge_report["labels"]["super"][0]
    said = bridge_report["results"][first].removeprefix("ImportError: ")
    assert bridge_report["as_script"] == f"{bridge_report['script']}: {said}"
    assert "\n" not in bridge_report["as_script"]


def test_the_config_path_never_calls_transformer_engine(bridge_report: dict[str, Any]):
    assert bridge_report["te_calls"] == []


def test_validate_rejects_a_world_size_the_layout_does_not_fit(bridge_report: dict[str, Any]):
    """The check has teeth: the same nano recipe fails Bridge's validate() at WORLD_SIZE=3."""
    assert bridge_report["results"][bridge_report["labels"]["nano"][0]] == "ok"
    assert bridge_report["results"][UNFIT] != "ok"


def test_the_transformer_engine_stub_records_every_call():
    """So an empty ``te_calls`` means nothing called it (no Bridge import needed)."""
    probe = (
        "import bridge_te_stub; bridge_te_stub.install()\n"
        "import transformer_engine.pytorch as te\n"
        "try:\n    te.Linear(4, 4)\nexcept RuntimeError:\n    pass\n"
        "print(bridge_te_stub.CALLS)"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO / "tests"
    )
    assert done.stdout.strip() == "['transformer_engine.pytorch.Linear']"
