"""``factory plan`` of a program: each stage planned alone, the totals their sum, and
``--stage`` / ``--search`` on one stage."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from test_program import program_document, write

import factory
from factory.layout_search import search_layouts
from factory.planner.plan import plan
from factory.planner.program_plan import plan_program
from factory.proxy import derive_program_proxy
from factory.report.search_text import search_records
from factory.schemas import Blueprint
from factory.schemas.program import resolve_program


def _program() -> Blueprint:
    return Blueprint.model_validate(program_document())


def test_each_stage_is_planned_as_its_blueprint_alone() -> None:
    program = resolve_program(_program())
    planned = plan_program(program)
    assert [s.name for s in planned.stages] == ["phase1", "phase2", "sft"]
    for stage, resolved in zip(planned.stages, program, strict=True):
        assert stage.plan.to_dict() == plan(resolved.blueprint).to_dict()
        assert stage.seq_len == resolved.blueprint.data.seq_len
        assert stage.tokens == resolved.blueprint.tokens_per_step * resolved.steps
    sft = planned.stage("sft")
    assert sft.seq_len == 2048 and sft.plan.layout.world_size == 4
    with pytest.raises(KeyError, match="phase1, phase2, sft"):
        planned.stage("rl")


def test_the_totals_are_the_sums_of_the_stages() -> None:
    planned = plan_program(resolve_program(_program()))
    doc = planned.to_dict()
    totals, stages = doc["totals"], doc["stages"]
    assert totals["tokens"] == sum(s["tokens"] for s in stages)
    assert totals["steps"] == sum(s["steps"] for s in stages) == 60 + 40 + 30
    for key in ("wall_seconds", "gpu_hours", "energy_mwh"):
        assert totals[key] == pytest.approx(sum(s["plan"]["cost"][key] for s in stages))
    assert totals["total_flops"] == pytest.approx(
        sum(s["plan"]["training"]["total_flops"] for s in stages)
    )
    peaks = [s["plan"]["memory_per_rank_bytes"]["total"] for s in stages]
    assert totals["memory_per_rank_bytes"] == max(peaks)
    # the SFT stage's sequence is twice as long, so its peak differs from the others'
    assert peaks[2] != peaks[0]
    assert [s["schedule"] for s in stages] == [
        {"offset": 0, "steps": 100},
        {"offset": 60, "steps": 100},
        {"offset": 0, "steps": 30},
    ]


def test_a_blueprint_without_stages_keeps_the_one_stage_document() -> None:
    bp = Blueprint.model_validate(program_document(None))
    assert plan_program(resolve_program(bp)).to_dict() == plan(bp).to_dict()


def test_plan_json_of_a_program(cli, tmp_path: Path) -> None:
    status, out, err = cli("plan", str(write(tmp_path, program_document())), "--json")
    assert status == 0, err
    doc = json.loads(out)
    assert [s["name"] for s in doc["stages"]] == ["phase1", "phase2", "sft"]
    assert doc["totals"]["steps"] == 130
    assert doc["params"]["total"] == doc["stages"][0]["plan"]["params"]["total"]


def test_plan_text_of_a_program_has_a_row_per_stage_and_the_totals(cli, tmp_path: Path) -> None:
    status, out, err = cli("plan", str(write(tmp_path, program_document())), "--proxy")
    assert status == 0, err
    assert "Program: 3 stages" in out
    rows = [line.split()[0] for line in out.splitlines() if line.strip()]
    for name in ("phase1", "phase2", "sft", "total"):
        assert name in rows
    assert "program: 3 stages" in out and "not applicable" in out


def test_plan_of_one_stage_is_the_stage_blueprint_plan(cli, tmp_path: Path) -> None:
    path = str(write(tmp_path, program_document()))
    status, out, err = cli("plan", path, "--stage", "sft", "--json")
    assert status == 0, err
    sft = resolve_program(_program()).stage("sft").blueprint
    assert json.loads(out) == plan(sft).to_dict()


def test_an_unknown_stage_exits_2_with_a_suggestion(cli, tmp_path: Path) -> None:
    status, out, err = cli("plan", str(write(tmp_path, program_document())), "--stage", "stf")
    assert status == 2 and out == ""
    assert "no stage 'stf' (did you mean 'sft'?)" in err and "phase1, phase2, sft" in err


def test_a_blueprint_without_stages_has_the_stage_train(cli, tmp_path: Path) -> None:
    path = str(write(tmp_path, program_document(None)))
    status, out, _ = cli("plan", path, "--stage", "train", "--json")
    assert status == 0 and "stages" not in json.loads(out)


def test_search_of_a_program_needs_a_stage_and_names_them(cli, tmp_path: Path) -> None:
    path = str(write(tmp_path, program_document()))
    status, _, err = cli("plan", path, "--search", "--gpus", "4")
    assert status == 2
    assert "--stage" in err and "phase1, phase2, sft" in err


def test_search_of_a_stage_searches_its_sequence_and_layout(cli, tmp_path: Path) -> None:
    path = str(write(tmp_path, program_document()))
    status, out, err = cli("plan", path, "--search", "--gpus", "4", "--stage", "sft", "--json")
    assert status == 0, err
    layouts = json.loads(out)["layouts"]
    sft = resolve_program(_program()).stage("sft").blueprint
    assert layouts == search_records(search_layouts(sft, 4, keep_pattern=True))
    status, out, err = cli("plan", path, "--search", "--gpus", "4", "--stage", "sft")
    assert status == 0, err
    assert "tiny stage 'sft' on 4 x" in out and "best in the program: stages[2].parallelism" in out


def test_a_stage_search_never_changes_the_model() -> None:
    """Virtual pipeline stages put '|' in the pattern, which a stage cannot write."""
    document = program_document(None)
    document["model"]["pattern"] = "M*ME-*ME"  # 8 layers: pp 2 x vpp 2 divides them
    bp = Blueprint.model_validate(document)

    def patterns(keep: bool) -> set[str]:
        found = search_layouts(bp, 4, top=200, keep_pattern=keep)
        return {o for r in found for o in r.overrides if o.startswith("model.pattern")}

    assert patterns(keep=False) and not patterns(keep=True)


def test_planning_a_program_imports_no_torch(tmp_path: Path) -> None:
    path = write(tmp_path, program_document())
    script = f"""
import sys
from factory.cli.app import main
assert main(["plan", {str(path)!r}]) == 0
heavy = sorted(m for m in sys.modules if m.split(".")[0] in {{"torch", "numpy"}})
assert not heavy, heavy
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def _built(folder: Path, samples: int, seq_len: int) -> None:
    """A data build's manifest as far as the plan reads it (``packing``, as
    ``factory.data.build_manifest`` writes it)."""
    folder.mkdir(parents=True)
    packing = {"samples": samples, "tokens": samples * seq_len * 9 // 10, "seq_len": seq_len}
    (folder / "manifest.json").write_text(json.dumps({"packing": packing}))


def test_each_stage_says_its_epochs_over_its_built_data(cli, tmp_path: Path) -> None:
    data = tmp_path / "data"
    _built(data / "phase1", 480, 1024)  # 60 steps x 16 sequences: 2 epochs
    _built(data / "phase2", 1280, 1024)  # 40 x 16: half an epoch
    _built(data / "sft", 60, 4096)  # 30 x 8 = 240 samples, but packed at another length
    path = str(write(tmp_path, program_document()))
    status, out, err = cli("plan", path, "--data", str(data), "--json")
    assert status == 0, err
    curated = [stage["curated"] for stage in json.loads(out)["stages"]]
    assert [c["epochs"] for c in curated] == [2.0, 0.5, 4.0]
    assert curated[0] == {"samples": 480, "tokens": 442368, "seq_len": 1024, "epochs": 2.0}
    status, out, err = cli("plan", path, "--data", str(data))
    assert status == 0, err
    text = " ".join(out.split())
    assert "stage 'phase1': 2 epochs over its curated data (480 samples of 1,024 tokens" in text
    assert "packed at 4,096, but it trains at 2,048: rebuild it" in text


def test_a_stage_without_built_data_is_named(cli, tmp_path: Path) -> None:
    data = tmp_path / "data"
    _built(data / "phase1", 480, 1024)
    path = str(write(tmp_path, program_document()))
    status, out, err = cli("plan", path, "--data", str(data))
    assert status == 2 and out == ""
    assert f"--data: {data / 'phase2'}: no such folder" in err


def test_a_blueprint_without_stages_reads_its_data_folder_itself(cli, tmp_path: Path) -> None:
    _built(tmp_path / "data", 400, 1024)  # 100 steps x 16 sequences: 4 epochs
    path = str(write(tmp_path, program_document(None)))
    status, out, err = cli("plan", path, "--data", str(tmp_path / "data"), "--json")
    assert status == 0, err
    doc = json.loads(out)
    assert doc["curated"]["epochs"] == 4.0
    assert {k: v for k, v in doc.items() if k != "curated"} == plan(
        Blueprint.model_validate(program_document(None))
    ).to_dict()


def test_each_stage_of_a_program_table_is_one_line_at_80_columns(cli) -> None:
    """A number folded over two lines reads as two numbers: every stage's row holds its
    name, sequence length and steps whole."""
    status, out, err = cli("plan", "super")
    assert status == 0, err
    lines = out.splitlines()
    for stage in resolve_program(factory.load_blueprint("super")):
        name, seq_len, steps = stage.name, stage.blueprint.data.seq_len, stage.steps
        row = [line for line in lines if line.split()[:1] == [name] and " x " not in line]
        assert row, name
        assert f"{seq_len:,}" in row[0] and f"{steps:,}" in row[0], row[0]


def test_a_program_proxy_plan_is_the_proxy_that_trains(cli) -> None:
    """``plan --proxy`` plans each stage's proxy as ``train --proxy`` derives it: one model,
    the program's proxy sequence lengths (factory.proxy.derive_program_proxy)."""
    status, out, err = cli("plan", "nano", "--proxy", "--json")
    assert status == 0, err
    planned = [stage["seq_len"] for stage in json.loads(out)["stages"]]
    stages = [stage.blueprint for stage in resolve_program(factory.load_blueprint("nano"))]
    assert planned == [bp.data.seq_len for bp in derive_program_proxy(stages)]
    assert planned != [bp.data.seq_len for bp in stages]
