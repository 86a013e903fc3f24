"""factory export hf --stage: the final (default) or a named stage of a program's blueprint or
of a run folder (RUN/program.json, RUN/<stage>/model/), and an unknown stage refused."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import yaml
from blueprint_factory import BASE, make
from program_blueprints import STAGES, program

from factory.exports.hf_config import ExportError
from factory.exports.hf_stage import UnknownStage, copy_run_model, stage_of


def program_run(tmp_path: Path, finished: tuple[str, ...] = ("phase1", "phase2", "sft")) -> Path:
    """A program's run folder as training leaves it; each model's bytes name its stage."""
    run = tmp_path / "run"
    stages = [{"name": s["name"], "status": "completed", "steps": 1} for s in STAGES]
    run.mkdir()
    (run / "program.json").write_text(json.dumps({"blueprint": "tiny", "stages": stages}))
    for name in finished:
        (run / name / "model").mkdir(parents=True)
        (run / name / "model" / "config.json").write_text(json.dumps({"stage": name}))
        (run / name / "model" / "model.safetensors").write_bytes(name.encode())
    return run


def test_a_blueprint_exports_its_final_stage_or_the_named_one():
    bp = program()
    assert stage_of(bp, None).name == "sft"
    assert stage_of(bp, "phase2").blueprint.data.recipe == "super"
    with pytest.raises(UnknownStage, match="did you mean 'phase2'"):
        stage_of(bp, "phase_2")
    plain = make()
    assert stage_of(plain, None).blueprint is plain  # no stages: the blueprint itself


def test_a_run_folder_gives_the_final_stage_model_by_default(tmp_path: Path):
    run = program_run(tmp_path)
    assert copy_run_model(run, tmp_path / "out") == run / "sft" / "model"
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == b"sft"
    copy_run_model(run, tmp_path / "one", "phase1")
    assert json.loads((tmp_path / "one" / "config.json").read_text()) == {"stage": "phase1"}


def test_a_stage_without_its_model_yet_is_refused(tmp_path: Path):
    run = program_run(tmp_path, finished=("phase1",))
    with pytest.raises(ExportError, match="'sft' has not finished training"):
        copy_run_model(run, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_run_without_stages_is_its_one_stage(tmp_path: Path):
    run = tmp_path / "run"
    (run / "model").mkdir(parents=True)
    (run / "model" / "config.json").write_text("{}")
    (run / "model" / "model.safetensors").write_bytes(b"weights")
    copy_run_model(run, tmp_path / "out", "train")
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == b"weights"
    with pytest.raises(UnknownStage, match="the program has train"):
        copy_run_model(run, tmp_path / "other", "sft")


def test_cli_unknown_stage_exits_2_with_did_you_mean(cli, tmp_path: Path):
    run = program_run(tmp_path)
    status, _, err = cli("export", "hf", str(run), "--stage", "phse1", "--out", str(tmp_path / "o"))
    assert status == 2
    assert "--stage: no stage 'phse1'" in err and "did you mean 'phase1'?" in err
    assert not (tmp_path / "o").exists()
    status, _, err = cli("export", "hf", str(run), "--proxy", "--out", str(tmp_path / "o"))
    assert status == 2 and "a run folder holds its model" in err
    status, _, err = cli(
        "export", "hf", str(run), "--stage", "phase2", "--out", str(tmp_path / "o")
    )
    assert status == 0, err
    assert (tmp_path / "o" / "model.safetensors").read_bytes() == b"phase2"


def test_cli_exports_a_named_stage_of_a_blueprint(cli, tmp_path: Path):
    document = copy.deepcopy(BASE) | {"stages": copy.deepcopy(STAGES)}
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    status, _, err = cli("export", "hf", str(path), "--stage", "sf", "--out", str(tmp_path / "x"))
    assert status == 2 and "did you mean 'sft'?" in err
    status, _, err = cli(
        "export", "hf", str(path), "--stage", "phase1", "--out", str(tmp_path / "m")
    )
    assert status == 0, err
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert config["hidden_size"] == BASE["model"]["hidden_size"]
    assert (tmp_path / "m" / "model.safetensors").stat().st_size > 0
