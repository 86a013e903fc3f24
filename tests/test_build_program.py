"""``factory build`` of a program (a blueprint with ``stages``): per-stage data, a smoke run
through every stage, per-stage records in build.json, and the page's timeline, whose
numbers come from the blueprint.

The program is Nano's model over three shipped recipes: pretraining, an anneal that
continues its schedule on the same recipe (so the two share one curation), and a
fine-tuning stage on another recipe at twice the sequence length, with its own layout and
a fresh optimizer. The build runs once per session (3 steps per stage), without the model
stage (the meta-device check is the single-stage build's, unchanged).
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from browser import chromium, render_page
from one_stage import one_stage

import factory
from factory.data.shards.heldout import heldout_sets
from factory.jobs.build import STAGES, build
from factory.jobs.build_program import (
    curations,
    program_plan,
    stage_fall,
    stage_proxies,
)
from factory.planner.program_plan import plan_program
from factory.report.program_timeline import MIN_BAND, PLOT, band_widths
from factory.report.units import human_gpu_hours
from factory.runtime.schedule import learning_rate
from factory.schemas.blueprint import Blueprint
from factory.schemas.program import resolve_program

ARTIFACTS = Path(__file__).resolve().parents[1] / "test-artifacts"
STEPS = 3
SKIPPED = ("model",)

PROGRAM_STAGES: list[dict[str, Any]] = [
    {"name": "pretrain", "description": "the base blend", "data": {"recipe": "nano"},
     "training": {"steps": 9000}},
    {"name": "anneal", "description": "the decay, continued", "continue_schedule": True,
     "training": {"steps": 1000}},
    {"name": "sft", "description": "chat", "carry": {"optimizer": False},
     "data": {"recipe": "nemotron_h_8b", "seq_len": 16384},
     "parallelism": {"tp": 8, "global_batch_size": 64},
     "training": {"steps": 500, "optimizer": {"lr": 5e-5, "min_lr": 5e-6},
                  "schedule": {"kind": "cosine", "warmup_fraction": 0.1}}},
]  # fmt: skip


def small_program() -> Blueprint:
    document = factory.load_blueprint("nano").model_dump(mode="json", exclude_unset=True)
    return Blueprint.model_validate({**document, "stages": PROGRAM_STAGES})


@pytest.fixture(scope="session")
def program_build(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("program") / "nano-program"
    build(small_program(), out=out, steps=STEPS, check_steps=2, skip=SKIPPED)
    return out


def _record(out: Path) -> dict[str, Any]:
    return json.loads((out / "build.json").read_text())["stages"]


def test_the_planned_program_is_the_blueprints_stages() -> None:
    bp = small_program()
    program = resolve_program(bp)
    planned = program_plan(bp, program)
    assert [s["name"] for s in planned["stages"]] == ["pretrain", "anneal", "sft"]
    for stage, record in zip(program, planned["stages"], strict=True):
        full = stage.blueprint
        assert record["steps"] == stage.steps
        assert (
            record["tokens"] == stage.steps * full.parallelism.global_batch_size * full.data.seq_len
        )
        assert record["seq_len"] == full.data.seq_len and record["recipe"] == full.data.recipe
        assert record["layout"]["tp"] == full.parallelism.tp
        for step, rate in record["lr"]:
            assert rate == learning_rate(stage.schedule_offset + step, stage.schedule_steps,
                                         full.training)  # fmt: skip
        assert record["lr"][0][0] == 0 and record["lr"][-1][0] == stage.steps - 1
    pretrain, anneal, sft = planned["stages"]
    assert planned["tokens"] == sum(s["tokens"] for s in planned["stages"])
    # One schedule over pretrain and anneal: the anneal goes on where pretraining stopped
    # and ends at min_lr; the SFT stage warms up from its own start.
    assert anneal["schedule"]["offset"] == 9000 and anneal["schedule"]["steps"] == 10000
    assert anneal["lr"][-1][1] == pytest.approx(bp.training.optimizer.min_lr)
    assert sft["lr"][0][1] == pytest.approx(5e-5 / 50)  # 10% of 500 steps of warmup
    assert (sft["layout"]["tp"], pretrain["layout"]["tp"]) == (8, 4)
    proxies = stage_proxies(program)
    assert [s["proxy_seq_len"] for s in planned["stages"]] == [p.data.seq_len for p in proxies]
    alone = plan_program(program)
    for record in planned["stages"]:  # the planner's figures of each stage on its own layout
        result = alone.stage(record["name"]).plan
        assert record["predicted"]["gpu_hours"] == result.cost.gpu_hours
        assert record["predicted"]["memory_per_rank_bytes"] == result.memory.total
    assert planned["predicted"]["gpu_hours"] == pytest.approx(alone.totals.gpu_hours)
    assert proxies[2].data.seq_len == 2 * proxies[0].data.seq_len


def test_stages_of_one_recipe_and_length_share_one_curation() -> None:
    found = curations(resolve_program(small_program()))
    assert [(c.recipe, c.stages) for c in found] == [
        ("nano", ("pretrain", "anneal")),
        ("nemotron_h_8b", ("sft",)),
    ]


def test_stage_verdicts() -> None:
    """The first stage must fall; a later one must stay finite and below the untrained start,
    whatever its trend over a few steps (batches of a new mixture differ in difficulty)."""
    assert stage_fall("a", [8.0, 7.0, 6.0, 5.0], None).passed
    assert not stage_fall("a", [8.0, 8.0, 7.9, 7.9], None).passed  # fresh weights, flat
    climbing = stage_fall("sft", [5.04, 5.30, 5.91, 6.55, 6.10, 6.47, 6.11, 6.22], start=8.05)
    assert climbing.passed and "below the start 8.050" in climbing.describe()
    assert not stage_fall("b", [8.1, 8.2, 8.1, 8.3], start=8.05).passed  # back at untrained
    assert not stage_fall("b", [6.0, math.nan, 5.0, 5.0], start=8.05).passed
    assert not stage_fall("b", [6.0, 7.0, 30.0, 60.0], start=8.05).passed  # diverging


def test_band_widths_are_proportional_above_the_minimum() -> None:
    widths = band_widths([20e12, 5e12, 121e9, 13e9])
    assert sum(widths) == pytest.approx(PLOT)
    assert widths[2] == widths[3] == MIN_BAND
    assert widths[0] / widths[1] == pytest.approx(4.0)
    assert band_widths([3, 3, 3]) == pytest.approx([PLOT / 3] * 3)


def test_a_program_build_records_data_smoke_and_check_per_stage(program_build: Path) -> None:
    record = _record(program_build)
    assert [record[s]["status"] for s in STAGES if s not in SKIPPED][:-1] == ["done"] * (
        len(STAGES) - 1 - len(SKIPPED)
    )
    data, smoke = record["data"]["program"], record["smoke"]["program"]
    assert list(data) == list(smoke) == ["pretrain", "anneal", "sft"]
    assert data["anneal"]["shared_with"] == "pretrain" and data["sft"]["shared_with"] is None
    proxies = stage_proxies(resolve_program(small_program()))
    for (name, entry), proxy in zip(data.items(), proxies, strict=True):
        manifest = json.loads((program_build / "data" / name / "manifest.json").read_text())
        assert entry["seq_len"] == proxy.data.seq_len == manifest["packing"]["seq_len"]
        assert entry["samples"] == manifest["packing"]["samples"] > 0
        # each stage's recipe holds out its own documents (the shipped recipes hold some out)
        assert heldout_sets(program_build / "data" / name), name
    shard = sorted((program_build / "data" / "anneal").rglob("*.tar"))[0]
    twin = (
        program_build / "data" / "pretrain" / shard.relative_to(program_build / "data" / "anneal")
    )
    assert os.path.samefile(shard, twin)  # one curation, hard-linked
    for name, verdict in smoke.items():
        assert verdict["passed"] and verdict["steps"] == STEPS, name
        assert (program_build / "smoke" / name / "metrics.jsonl").is_file()
        assert (program_build / "smoke" / name / "model" / "model.safetensors").is_file()
    assert smoke["pretrain"]["start"] is None
    assert smoke["sft"]["start"] == smoke["anneal"]["start"] == smoke["pretrain"]["first"]
    program = json.loads((program_build / "smoke" / "program.json").read_text())
    assert [s["status"] for s in program["stages"]] == ["completed"] * 3
    assert not list(program_build.rglob("checkpoints"))
    check = json.loads((program_build / "distributed.json").read_text())
    assert check["stage"] == "pretrain" and check["passed"]
    assert (program_build / "program_plan.json").is_file()


def test_a_rerun_reuses_the_program_build(program_build: Path) -> None:
    again = build(small_program(), out=program_build, steps=STEPS, check_steps=2, skip=SKIPPED)
    statuses = {r.stage: r.status for r in again.stages}
    assert statuses == {s: "skipped" if s in SKIPPED else "done" if s == "report" else "reused"
                        for s in STAGES}  # fmt: skip
    assert again.stages[STAGES.index("smoke")].program == _record(program_build)["smoke"]["program"]


def test_a_single_stage_build_writes_no_program(tmp_path: Path) -> None:
    out = tmp_path / "nano"
    build(one_stage("nano"), out=out,
          skip=[s for s in STAGES if s not in ("validate", "plan", "report")])  # fmt: skip
    assert not (out / "program_plan.json").exists()
    assert all("program" not in entry for entry in _record(out).values())
    page = (out / "report.html").read_text()
    assert 'id="program"' not in page and 'href="#program"' not in page


def _scale_widths(page: str, css: str) -> dict[str, float]:
    figure = page.split(f'class="{css}"', 1)[1].split("</svg>", 1)[0]
    found = re.findall(r'<rect class="scale" data-stage="([^"]+)" x="[^"]+" y="[^"]+" '
                       r'width="([^"]+)"', figure)  # fmt: skip
    return {name: float(width) for name, width in found}


def test_the_timeline_draws_the_blueprints_numbers(program_build: Path) -> None:
    page = (program_build / "report.html").read_text()
    assert '<section id="program">' in page and 'href="#program"' in page
    bp, program = small_program(), resolve_program(small_program())
    tokens = {s.name: s.steps * s.blueprint.tokens_per_step for s in program}
    widths = _scale_widths(page, "timeline planned")
    assert list(widths) == list(tokens)
    for name, width in widths.items():  # the strip to scale: width / PLOT = share of tokens
        assert width == pytest.approx(PLOT * tokens[name] / sum(tokens.values()), abs=1e-3)
    smoke = _scale_widths(page, "timeline smoke")
    assert list(smoke) == list(tokens) and len(set(smoke.values())) == 1  # 3 steps each
    text = re.sub(r"<[^>]+>", " ", page)
    for stage in program:
        full = stage.blueprint
        assert f"{full.data.seq_len:,}" in text and f"{stage.steps:,} steps" in text
    assert "TP 8 · EP 8" in text and "TP 4 · EP 8" in text  # the SFT stage's own layout
    planned = json.loads((program_build / "program_plan.json").read_text())
    assert human_gpu_hours(planned["predicted"]["gpu_hours"]) in text  # the program's total
    for name in tokens:  # each stage's mixture, a bar per category from its manifest
        manifest = json.loads((program_build / "data" / name / "manifest.json").read_text())
        drawn = re.findall(rf'class="mix" data-stage="{name}" data-what="curated" '
                           r'data-category="([^"]+)"', page)  # fmt: skip
        assert sorted(drawn) == sorted(c for c, v in manifest["categories"].items() if v["tokens"])
    assert bp.meta.name in page


@pytest.mark.skipif(
    chromium() is None and not os.environ.get("CI"),
    reason="Chromium is not installed (apt-get install chromium)",
)
def test_the_program_page_renders_in_chromium(program_build: Path) -> None:
    shot = ARTIFACTS / "build_program_report.png"
    shot.unlink(missing_ok=True)
    page = render_page(program_build / "report.html", shot, width=1280)
    print(f"program build report screenshot: {shot}")
    assert page.errors == [] and page.blank == []
    classes = [svg["cls"] for svg in page.svgs]
    assert classes[:3] == ["timeline planned", "timeline smoke", "mixture"]
    for svg in page.svgs[:3]:
        assert svg["shapes"] > 10 and svg["bbox_width"] > 900 and svg["bbox_height"] > 150, svg
    assert page.width <= 1280


def test_the_cli_builds_a_program_file(cli, tmp_path: Path) -> None:
    """``factory build FILE`` of a program: one line per build stage naming the program's
    stages, and the planned program beside the plan."""
    source = tmp_path / "program.yaml"
    document = small_program().model_dump(mode="json", exclude_none=True)
    source.write_text(yaml.safe_dump(document), encoding="utf-8")
    skips = [a for s in ("model", "data", "smoke", "distributed") for a in ("--skip", s)]
    status, _, err = cli("build", str(source), "--out", str(tmp_path / "b"), *skips)
    assert status == 0, err
    text = " ".join(err.split())
    assert "(program: pretrain, anneal, sft)" in text and "program of 3 stages" in text
    planned = json.loads((tmp_path / "b" / "program_plan.json").read_text())
    assert [s["name"] for s in planned["stages"]] == ["pretrain", "anneal", "sft"]


def test_a_failed_stage_and_a_skipped_plan_are_drawn_as_such(
    program_build: Path, tmp_path: Path
) -> None:
    """A stage the smoke run failed is marked failed on the timeline; without the plan
    stage's program_plan.json the planned timeline is a note and the smoke run still draws."""
    import shutil

    from factory.report.build_page import write_build_report

    copy = tmp_path / "copy"
    shutil.copytree(program_build, copy)
    document = json.loads((copy / "build.json").read_text())
    smoke = document["stages"]["smoke"]
    smoke["status"] = "failed"
    smoke["program"]["sft"]["passed"] = False
    document["stages"]["plan"] = {"status": "skipped", "seconds": 0.0, "result": "skipped (--skip)"}
    (copy / "build.json").write_text(json.dumps(document))
    (copy / "program_plan.json").unlink()
    page = write_build_report(copy).read_text()
    section = page.split('<section id="program">', 1)[1].split("</section>", 1)[0]
    assert "No planned program: the plan stage skipped" in section
    assert section.count("✓ passed") == 2 and section.count("✗ failed") == 1
    assert 'class="timeline smoke"' in section and 'class="timeline planned"' not in section
