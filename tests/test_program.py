"""A blueprint's stages: each resolved into a whole blueprint, and bad programs refused at
validate with ``file:line: dotted.path: message``."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml
from blueprint_factory import BASE

from factory.checks.validate import load
from factory.errors import BlueprintError
from factory.schemas import Blueprint
from factory.schemas.program import DEFAULT_STAGE, resolve_program

THREE_STAGES: list[dict[str, Any]] = [
    {"name": "phase1", "training": {"steps": 60}},
    {
        "name": "phase2",
        "continue_schedule": True,
        "data": {"recipe": "super"},
        "training": {"steps": 40},
    },
    {
        "name": "sft",
        "data": {"seq_len": 2048},
        "parallelism": {"world_size": 4, "global_batch_size": 8},
        "training": {"steps": 30, "optimizer": {"lr": 1e-5}, "schedule": {"kind": "cosine"}},
        "carry": {"optimizer": False},
    },
]


def program_document(stages: list[dict[str, Any]] | None = THREE_STAGES) -> dict[str, Any]:
    document = copy.deepcopy(BASE)
    document["data"]["recipe"] = "nano"
    if stages is not None:
        document["stages"] = copy.deepcopy(stages)
    return document


def write(tmp_path: Path, document: dict[str, Any]) -> Path:
    path = tmp_path / "program.yaml"
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    return path


def errors_of(tmp_path: Path, document: dict[str, Any]) -> list[str]:
    with pytest.raises(BlueprintError) as caught:
        load(write(tmp_path, document))
    return [d.format() for d in caught.value.errors if d.severity == "error"]


def line_of(path: Path, text: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if text in line)


def test_a_blueprint_without_stages_is_one_implicit_stage() -> None:
    bp = Blueprint.model_validate(program_document(None))
    program = resolve_program(bp)
    assert len(program) == 1 and not program.declared
    only = program.final
    assert only.name == DEFAULT_STAGE and only.blueprint is bp
    assert (only.schedule_offset, only.schedule_steps) == (0, bp.training_steps)


def test_each_stage_is_the_stage_before_with_its_changes() -> None:
    program = resolve_program(Blueprint.model_validate(program_document()))
    phase1, phase2, sft = program
    assert [s.name for s in program] == ["phase1", "phase2", "sft"]
    assert phase1.blueprint.data.recipe == "nano"
    assert phase2.blueprint.data.recipe == "super"
    assert sft.blueprint.data.recipe == "super"  # inherited from the stage before
    assert sft.blueprint.data.seq_len == 2048 and phase2.blueprint.data.seq_len == 1024
    assert sft.blueprint.parallelism.world_size == 4
    assert sft.blueprint.training.optimizer.lr == 1e-5
    assert phase2.blueprint.training.optimizer.lr == 3e-4
    assert all(s.blueprint.stages is None for s in program)
    assert all(s.blueprint.model == phase1.blueprint.model for s in program)
    assert not sft.carry.optimizer and phase2.carry.optimizer


def test_a_continued_schedule_spans_its_stages() -> None:
    phase1, phase2, sft = resolve_program(Blueprint.model_validate(program_document()))
    assert (phase1.schedule_offset, phase1.schedule_steps) == (0, 100)
    assert (phase2.schedule_offset, phase2.schedule_steps) == (60, 100)
    assert (sft.schedule_offset, sft.schedule_steps) == (0, 30)


def test_a_stage_derives_defaults_again_from_what_it_changes() -> None:
    """Merging what the author wrote, not the filled-in base: a default derived from another
    field follows the stage's value."""
    stages = [{"name": "a"}, {"name": "b", "parallelism": {"world_size": 2}}]
    a, b = resolve_program(Blueprint.model_validate(program_document(stages)))
    assert (a.blueprint.parallelism.world_size, b.blueprint.parallelism.world_size) == (8, 2)
    assert b.blueprint == Blueprint.model_validate(
        {**program_document(None), "parallelism": {"world_size": 2, "global_batch_size": 16}}
    )


def test_a_valid_program_validates_with_no_errors(tmp_path: Path) -> None:
    loaded = load(write(tmp_path, program_document()))
    assert loaded.blueprint.stages is not None


def test_an_unknown_stage_field_is_located_with_a_suggestion(tmp_path: Path) -> None:
    stages = copy.deepcopy(THREE_STAGES)
    stages[2]["data"]["seq_length"] = 4096
    path = write(tmp_path, program_document(stages))
    with pytest.raises(BlueprintError) as caught:
        load(path)
    (error,) = caught.value.errors
    assert error.path == "stages[2].data.seq_length"
    assert error.line == line_of(path, "seq_length")
    assert "did you mean 'seq_len'" in error.message


def test_an_unknown_key_of_a_stage_itself_is_refused(tmp_path: Path) -> None:
    stages = copy.deepcopy(THREE_STAGES)
    stages[1]["carry_over"] = {"optimizer": True}
    (error,) = errors_of(tmp_path, program_document(stages))
    assert "stages[1].carry_over: unknown key" in error and "did you mean 'carry'" in error


def test_a_stage_cannot_change_the_model(tmp_path: Path) -> None:
    stages = copy.deepcopy(THREE_STAGES)
    stages[2]["model"] = {"hidden_size": 512}
    path = write(tmp_path, program_document(stages))
    with pytest.raises(BlueprintError) as caught:
        load(path)
    (error,) = caught.value.errors
    assert error.path == "stages[2].model" and "hidden_size" in error.message
    assert error.line == line_of(path, "hidden_size: 512") - 1


def test_an_empty_program_is_refused(tmp_path: Path) -> None:
    (error,) = errors_of(tmp_path, program_document([]))
    assert "stages: an empty program" in error


def test_stage_names_are_unique(tmp_path: Path) -> None:
    stages = copy.deepcopy(THREE_STAGES)
    stages[2]["name"] = "phase1"
    (error,) = errors_of(tmp_path, program_document(stages))
    assert "each stage name once; phase1" in error


def test_a_stage_sequence_longer_than_the_model_is_refused_at_the_stage(tmp_path: Path) -> None:
    stages = copy.deepcopy(THREE_STAGES)
    stages[2]["data"]["seq_len"] = 8192
    path = write(tmp_path, program_document(stages))
    with pytest.raises(BlueprintError) as caught:
        load(path)
    (error,) = [d for d in caught.value.errors if d.severity == "error"]
    assert error.path == "stages[2].data.seq_len"
    assert error.line == line_of(path, "seq_len: 8192")
    assert "stage 'sft'" in error.message and "8192" in error.message


def test_a_stage_layout_that_cannot_run_is_refused_at_the_stage(tmp_path: Path) -> None:
    stages = copy.deepcopy(THREE_STAGES)
    stages[2]["parallelism"]["tp"] = 3
    messages = errors_of(tmp_path, program_document(stages))
    assert messages and all("stage 'sft'" in m for m in messages)
    assert any("stages[2].parallelism.tp: stage 'sft': tp=3 must divide" in m for m in messages)


def test_the_first_stage_has_no_schedule_to_continue(tmp_path: Path) -> None:
    stages = copy.deepcopy(THREE_STAGES)
    stages[0]["continue_schedule"] = True
    (error,) = errors_of(tmp_path, program_document(stages))
    assert "stages[0].continue_schedule: the first stage has no schedule" in error


def test_a_stage_continuing_the_schedule_keeps_it(tmp_path: Path) -> None:
    stages = copy.deepcopy(THREE_STAGES)
    stages[1]["training"]["optimizer"] = {"lr": 1e-4}
    (error,) = errors_of(tmp_path, program_document(stages))
    assert "stages[1].training.optimizer: this stage continues the schedule" in error


def test_carrying_the_data_position_needs_the_same_data(tmp_path: Path) -> None:
    stages = copy.deepcopy(THREE_STAGES)
    stages[1]["carry"] = {"data_position": True}
    (error,) = errors_of(tmp_path, program_document(stages))
    assert "stages[1].carry.data_position" in error and "data.recipe changes" in error


def test_a_finding_every_stage_shares_is_reported_once_without_stage_names(
    tmp_path: Path,
) -> None:
    document = program_document()
    document["parallelism"]["tp"] = 3  # the heads refuse it in every stage
    messages = errors_of(tmp_path, document)
    heads = [m for m in messages if "must divide attention heads" in m]
    assert len(heads) == 1 and ": parallelism.tp: tp=3" in heads[0]
    # the world-size rule fails per stage: the first two stages share it, the SFT its own
    sizes = [m for m in messages if "is not divisible by tp*cp*pp" in m]
    assert len(sizes) == 2
    assert "parallelism.world_size: stages 'phase1', 'phase2': world_size (8)" in sizes[0]
    assert "stages[2].parallelism.world_size: stage 'sft': world_size (4)" in sizes[1]


def test_a_stage_field_can_be_overridden_on_the_command_line(tmp_path: Path) -> None:
    path = write(tmp_path, program_document())
    for key in ("stages.2.data.seq_len", "stages[2].data.seq_len"):
        loaded = load(path, [f"{key}=512"])
        assert resolve_program(loaded.blueprint).stage("sft").blueprint.data.seq_len == 512
    with pytest.raises(BlueprintError) as caught:
        load(path, ["stages.2.parallelism.tp=3"])
    assert any(
        d.file == "--set" and d.path.startswith("stages[2].parallelism")
        for d in caught.value.errors
    )
    with pytest.raises(BlueprintError) as caught:
        load(path, ["stages.7.data.seq_len=512"])
    (error,) = caught.value.errors
    assert error.path == "stages[7].data.seq_len" and "bad override" in error.message


def test_a_stage_giving_steps_drops_the_tokens_it_would_inherit() -> None:
    document = program_document(
        [{"name": "a", "training": {"tokens": "1B"}}, {"name": "b", "training": {"steps": 7}}]
    )
    del document["training"]["steps"]
    a, b = resolve_program(Blueprint.model_validate(document))
    assert (a.blueprint.training.tokens, a.blueprint.training.steps) == (10**9, None)
    assert (b.blueprint.training.tokens, b.blueprint.training.steps) == (None, 7)
