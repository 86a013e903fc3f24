"""``factory build``: stages, records, reuse after a kill, and the training verdicts.

The full build (smoke run and 2-process check included) runs once, in
tests/test_report_build_page.py (its ``full_build`` fixture); here the training stages
are skipped.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from one_stage import one_stage

import factory
from factory.jobs.build import STAGES, BuildFailed, build
from factory.jobs.build_checks import compare_losses, loss_falls

FAST = ("smoke", "evaluate", "distributed", "report")


def _digests(out: Path) -> dict[str, str]:
    skip = {"build.json"}
    return {
        str(p.relative_to(out)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(out.rglob("*"))
        if p.is_file() and p.name not in skip
    }


@pytest.fixture(scope="module")
def fast_build(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("build") / "nano"
    build(one_stage("nano"), out=out, skip=FAST)
    return out


def test_every_stage_is_recorded_with_its_result(fast_build: Path) -> None:
    record = json.loads((fast_build / "build.json").read_text())
    assert list(record["stages"]) == list(STAGES)
    statuses = {name: stage["status"] for name, stage in record["stages"].items()}
    assert statuses == {s: ("skipped" if s in FAST else "done") for s in STAGES}
    check = json.loads((fast_build / "model_check.json").read_text())
    assert check["parameters"] == check["plan_parameters"] == 31_577_940_288
    assert "31,577,940,288 parameters = the plan" in record["stages"]["model"]["result"]
    assert (fast_build / "exports" / "megatron" / "recipe.py").is_file()
    hf = json.loads((fast_build / "exports" / "hf" / "config.json").read_text())
    assert hf["architectures"] == ["NemotronHForCausalLM"]
    precision = json.loads((fast_build / "precision.json").read_text())
    assert precision["modules"] and abs(sum(precision["flops_share"].values()) - 1) < 1e-9
    assert json.loads((fast_build / "data" / "manifest.json").read_text())["shards"]


def test_a_rerun_reuses_and_a_changed_blueprint_starts_over(
    fast_build: Path, tmp_path: Path
) -> None:
    out = tmp_path / "nano"
    shutil.copytree(fast_build, out)  # the module's build stays as it was
    bp = one_stage("nano")
    again = build(bp, out=out, skip=FAST)
    assert {r.status for r in again.stages} == {"reused", "skipped"}
    changed = bp.model_copy(update={"meta": bp.meta.model_copy(update={"description": "x"})})
    fresh = build(changed, out=out, skip=(*FAST, "data"))
    assert {r.status for r in fresh.stages} == {"done", "skipped"}
    assert not (out / "data").exists()  # the other blueprint's data went with the rest


def test_a_build_killed_after_a_stage_finishes_identical(fast_build: Path, tmp_path: Path) -> None:
    out = tmp_path / "nano"
    script = textwrap.dedent(f"""
        import os, signal, sys
        from pathlib import Path
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from one_stage import one_stage
        from factory.jobs.build import build

        def on_stage(record):
            if record.stage == "export":
                os.kill(os.getpid(), signal.SIGKILL)

        build(one_stage("nano"), out=Path({str(out)!r}), skip={FAST!r},
              on_stage=on_stage)
    """)
    killed = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=300)
    assert killed.returncode == -9, killed.stderr.decode()[-2000:]
    assert not (out / "data").exists()
    result = build(one_stage("nano"), out=out, skip=FAST)
    statuses = [r.status for r in result.stages]
    assert statuses[:5] == ["reused"] * 5 and statuses[5] == "done"
    assert _digests(out) == _digests(fast_build)
    assert not [p for p in out.rglob("*") if ".tmp" in p.name]


def test_bad_requests_are_refused_before_any_work(tmp_path: Path) -> None:
    bp = factory.load_blueprint("nano")
    with pytest.raises(ValueError, match="unknown stages"):
        build(bp, out=tmp_path / "a", skip=["smok"])
    with pytest.raises(ValueError, match="skip both or neither"):
        build(bp, out=tmp_path / "a", skip=["smoke"])
    with pytest.raises(ValueError, match="check_steps"):
        build(bp, out=tmp_path / "a", steps=4, check_steps=5)
    assert not (tmp_path / "a").exists()


def test_a_failed_stage_is_recorded_and_raised(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from factory.jobs import build_stages

    def wrong(ctx: build_stages.BuildContext) -> str:
        raise build_stages.StageFailed("the graph has 1 parameters, the plan 2")

    monkeypatch.setitem(build_stages._RUNNERS, "model", wrong)
    with pytest.raises(BuildFailed, match="model: the graph has 1"):
        build(one_stage("nano"), out=tmp_path / "b", skip=(*FAST, "data"))
    record = json.loads((tmp_path / "b" / "build.json").read_text())["stages"]
    assert record["model"]["status"] == "failed" and "precision" not in record


def test_the_cli_names_bad_stages_and_prints_one_line_per_stage(
    cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Wide enough that the "built" line, which holds tmp_path, is never wrapped (pytest-xdist
    # workers' tmp_path is longer than a serial run's).
    monkeypatch.setenv("COLUMNS", "400")
    status, _, err = cli("build", "nano", "--skip", "smok", "--out", str(tmp_path / "x"))
    assert status == 2 and "'smok' is not a stage" in err
    skips = [a for s in (*FAST, "data", "export") for a in ("--skip", s)]
    status, _, err = cli("build", "nano", "--out", str(tmp_path / "c"), *skips)
    assert status == 0, err
    assert "model" in err and "31,577,940,288 parameters = the plan" in err
    assert f"built nano -> {(tmp_path / 'c').resolve()}" in err


@given(st.lists(st.floats(0.5, 20), min_size=2, max_size=60), st.sampled_from([0.25, 2.0, 8.0]))
def test_the_fall_verdict_ignores_the_loss_scale(losses: list[float], scale: float) -> None:
    scaled = [scale * x for x in losses]  # powers of two: exact in floating point
    assert loss_falls(scaled).fell == loss_falls(losses).fell


def test_a_flat_or_rising_loss_does_not_fall_and_a_falling_one_does() -> None:
    assert not loss_falls([3.0] * 24).fell
    assert not loss_falls([3.0 + 0.01 * i for i in range(24)]).fell
    assert loss_falls([3.0 * 0.99**i for i in range(24)]).fell  # last quarter ~17% lower
    assert not loss_falls([3.0, 2.9, 3.0, 2.9]).fell  # 3% lower
    with pytest.raises(ValueError):
        loss_falls([3.0])


def test_loss_comparisons() -> None:
    same = compare_losses([2.0, 1.5], [2.0, 1.5])
    assert same.passed and same.max_relative_difference == 0
    off = compare_losses([2.0, 1.6], [2.0, 1.5], tolerance=1e-3)
    assert not off.passed and off.max_relative_difference == pytest.approx(0.1 / 1.5)
    with pytest.raises(ValueError):
        compare_losses([1.0], [1.0, 2.0])
