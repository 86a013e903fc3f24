"""factory export megatron of a program: one Bridge recipe per stage, chained by checkpoint.

The recipes are built and validated by the installed Megatron-Bridge (``bridge_validate.py`` in
a child process, with its Transformer Engine stub), which reports what each built config says
about its checkpoint chain, schedule, data and length; what a chain cannot say is refused at
the stage's field. SFT needs ``training.objective``; where the schema lacks it those tests skip.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import pytest
import yaml
from blueprint_factory import BASE
from conftest import REPO
from program_blueprints import STAGES, needs_objective, program, with_stage

from factory.checks.validate import load_blueprint
from factory.exports.megatron import MegatronExportError, export_megatron
from factory.schemas import Blueprint
from factory.schemas.program import resolve_program


def _bridge_installed() -> bool:
    try:
        version("megatron-bridge")
    except PackageNotFoundError:
        return False
    return True


needs_bridge = pytest.mark.skipif(not _bridge_installed(), reason="megatron-bridge not installed")


def refused(bp: Blueprint, tmp_path: Path) -> dict[str, str]:
    with pytest.raises(MegatronExportError) as caught:
        export_megatron(bp, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    return dict(caught.value.fields)


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return export_megatron(program(), tmp_path_factory.mktemp("program") / "out")


@pytest.fixture(scope="module")
def bridge(exported: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every recipe built and validated by the installed Bridge, in one child process."""
    if not _bridge_installed():
        pytest.skip("megatron-bridge not installed")
    resumed = tmp_path_factory.mktemp("resumed")
    (resumed / "latest_train_state.pt").write_bytes(b"")  # a tracker Bridge resumes from
    mbs = export_megatron(
        program(with_stage(2, parallelism={"micro_batch_size": 2, "global_batch_size": 8})),
        tmp_path_factory.mktemp("mbs") / "out",
        allow_unexpressed=True,
    )
    jobs = [
        [
            stage.name,
            str(exported / stage.name / "recipe.py"),
            stage.blueprint.parallelism.world_size,
        ]
        for stage in resolve_program(program())
    ]
    jobs.append(["phase2 resumed", jobs[1][1], 8, {"checkpoint_dir": str(resumed)}])
    jobs.append(["sft micro-batch 2", str(mbs / "sft" / "recipe.py"), 4])
    done = subprocess.run(
        [sys.executable, str(REPO / "tests" / "bridge_validate.py"), json.dumps(jobs)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO / "tests",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1]) | {"resumed": str(resumed)}


def test_one_recipe_folder_per_stage_and_an_index(exported: Path):
    names = [s["name"] for s in STAGES]
    assert sorted(p.name for p in exported.iterdir() if p.is_dir()) == sorted(names)
    for name in names:
        for file in ("recipe.py", "overrides.yaml", "launch.sh", "README.md", "hf/config.json"):
            assert (exported / name / file).is_file(), (name, file)
        compile((exported / name / "recipe.py").read_text(), "recipe.py", "exec")
    index = (exported / "README.md").read_text()
    rows = [line for line in index.splitlines() if line.startswith("| ") and "`" in line]
    assert [row.split("`")[1] for row in rows] == names
    # Bridge resumes phase 1's consumed samples (60 steps of 16); SFT starts a fine-tune.
    assert "from sample 960 on" in (exported / "phase2" / "README.md").read_text()
    assert "a fresh optimizer at iteration 0" in (exported / "sft" / "README.md").read_text()
    launch = (exported / "launch.sh").read_text()
    assert [launch.index(f"/{name}/launch.sh") for name in names] == sorted(
        launch.index(f"/{name}/launch.sh") for name in names
    )


@needs_bridge
def test_bridge_validates_every_stage(bridge: dict[str, Any]):
    results = dict(bridge["results"])
    results.pop("sft micro-batch 2")  # refused by the export and by Bridge: the next test
    assert results == dict.fromkeys([s["name"] for s in STAGES] + ["phase2 resumed"], "ok")
    assert bridge["te_calls"] == []


@needs_bridge
def test_each_stage_starts_from_the_checkpoint_before(bridge: dict[str, Any]):
    built = bridge["built"]
    first, second, sft = built["phase1"], built["phase2"], built["sft"]
    assert first["checkpoint.load"] == "checkpoints/tiny/phase1"
    assert first["checkpoint.pretrained_checkpoint"] is None
    # phase 2 carries the optimizer: the whole phase-1 checkpoint, the run's iterations go on.
    assert second["checkpoint.load"] == "checkpoints/tiny/phase1"
    assert second["scheduler.override_opt_param_scheduler"] is True
    assert second["train.train_iters"] == 100
    # ... onto TP=2, so phase 1 saves its distributed optimizer fully reshardable.
    assert first["checkpoint.dist_ckpt_optim_fully_reshardable"] is True
    assert second["checkpoint.dist_ckpt_optim_fully_reshardable"] is False
    # Once its own folder holds a checkpoint, the stage resumes that one.
    assert built["phase2 resumed"]["checkpoint.load"] == bridge["resumed"]
    # SFT carries no optimizer: a fine-tune from phase 2's weights, iteration 0.
    assert sft["checkpoint.pretrained_checkpoint"] == "checkpoints/tiny/phase2"
    assert sft["checkpoint.load"] == "checkpoints/tiny/sft"
    assert sft["train.train_iters"] == 30


@needs_bridge
def test_one_schedule_spans_the_stages_that_continue_it(bridge: dict[str, Any]):
    """Phase 1 and 2 share one 100-step WSD schedule; SFT starts its own."""
    built = bridge["built"]
    assert [built[s]["scheduler.lr_decay_iters"] for s in ("phase1", "phase2", "sft")] == [
        100,
        100,
        30,
    ]
    assert built["phase1"]["train.train_iters"] == 60


@needs_bridge
@needs_objective
def test_the_sft_stage_is_a_finetune_config_on_packed_sequences(
    bridge: dict[str, Any], exported: Path
):
    sft = bridge["built"]["sft"]
    assert sft["dataset"] == "FinetuningDatasetConfig"
    assert sft["dataset.packed_sequence_specs.packed_sequence_size"] == 2048
    assert sft["model.seq_length"] == 2048
    assert sft["model.calculate_per_token_loss"] is True
    assert bridge["built"]["phase2"]["dataset"] == "GPTDatasetConfig"
    recipe = (exported / "sft" / "recipe.py").read_text()
    assert "def tiny_sft_finetune_config(" in recipe
    assert "finetune(config, forward_step)" in recipe


@needs_bridge
@needs_objective
def test_bridge_itself_refuses_the_micro_batch_the_export_refuses(
    bridge: dict[str, Any], tmp_path: Path
):
    """The refusal has Bridge's reason: its validate() rejects packed micro-batches of 2."""
    assert bridge["results"]["sft micro-batch 2"].startswith("ValueError: Micro batch size")
    bp = program(with_stage(2, parallelism={"micro_batch_size": 2}))
    assert "stages[2].parallelism.micro_batch_size" in refused(bp, tmp_path)


@needs_objective
def test_a_per_conversation_average_is_refused_at_the_stage(tmp_path: Path):
    stages = with_stage(2, training={**STAGES[2]["training"], "objective": {
        "kind": "sft", "loss_average": "conversation"}})  # fmt: skip
    said = refused(program(stages), tmp_path)
    assert "per conversation" in said["stages[2].training.objective.loss_average"]


def test_a_schedule_restarting_inside_a_resumed_run_is_refused(tmp_path: Path):
    """Carrying the optimizer continues Megatron's iteration; a new WSD schedule cannot start
    at iteration 60."""
    stages = with_stage(1, continue_schedule=False)
    said = refused(program(stages), tmp_path)
    assert list(said) == ["stages[1].carry.optimizer"]
    assert "iteration 60" in said["stages[1].carry.optimizer"]


def test_a_constant_schedule_may_start_inside_a_resumed_run(tmp_path: Path):
    """Nano's long-context stage: optimizer carried, constant LR, no warmup."""
    long_context = {
        "name": "long",
        "data": {"seq_len": 2048},
        "training": {
            "steps": 20,
            "optimizer": {"lr": 1e-5, "min_lr": 1e-5},
            "schedule": {"kind": "constant", "warmup_fraction": 0.0},
        },
    }
    out = export_megatron(program([STAGES[0], long_context]), tmp_path / "out")
    recipe = (out / "long" / "recipe.py").read_text()
    assert "train_iters=80," in recipe and "lr_warmup_iters=0," in recipe
    assert "load=checkpoint_dir if _resumes(checkpoint_dir) else previous_checkpoint" in recipe


def test_continuing_a_schedule_without_the_optimizer_is_refused(tmp_path: Path):
    stages = with_stage(1, carry={"optimizer": False})
    assert "stages[1].continue_schedule" in refused(program(stages), tmp_path)


def test_carrying_the_data_position_into_a_fine_tune_is_refused(tmp_path: Path):
    stages = copy.deepcopy(STAGES[:2])
    stages[1] = {"name": "phase2", "carry": {"optimizer": False, "data_position": True}}
    assert "stages[1].carry.data_position" in refused(program(stages), tmp_path)


def test_a_stage_setting_megatron_cannot_express_is_refused_at_the_stage(tmp_path: Path):
    stages = with_stage(1, precision={"switch_to_bf16": {"after_fraction": 0.9}})
    said = refused(program(stages), tmp_path)
    assert list(said) == ["stages[1].precision.switch_to_bf16"]


def test_a_base_value_every_stage_keeps_is_refused_once_at_its_path(tmp_path: Path):
    said = refused(program(**{"model.mamba.conv_kernel": 3}), tmp_path)
    assert [path for path in said if "conv_kernel" in path] == ["model.mamba.conv_kernel"]


def test_cli_names_the_stage_field_and_writes_nothing(cli, tmp_path: Path):
    document = copy.deepcopy(BASE) | {"stages": with_stage(1, continue_schedule=False)}
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    load_blueprint(path)  # validate accepts it: only the export cannot say it
    status, _, err = cli("export", "megatron", str(path), "--out", str(tmp_path / "x"))
    assert status == 2
    assert "stages[1].carry.optimizer" in err
    assert not (tmp_path / "x").exists()
    status, _, err = cli(
        "export", "megatron", str(path), "--out", str(tmp_path / "y"), "--allow-unexpressed"
    )
    assert status == 0, err
    assert "stages[1].carry.optimizer" in (tmp_path / "y" / "phase2" / "README.md").read_text()
