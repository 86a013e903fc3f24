"""A blueprint's program trains stage after stage in one run folder, and resumes exactly.

Three stages of the tiny runtime blueprint (``runtime_helpers``): pretraining phase 1, phase
2 continuing its WSD schedule (the decay runs across the end of phase 2), then an SFT stage
with its own warmup and a fresh optimizer. ``factory train`` runs in child processes on one
thread each, so an interrupted program rerun must end bit for bit as the uninterrupted one:
every step's loss in every stage and the final stage's weights.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from runtime_helpers import tiny_blueprint
from train_cli_helpers import ENV, TIMEOUT, TWO_RANKS, losses, records, same_weights, signalled

import factory
from factory.runtime.batches import build_shards
from factory.runtime.optimizer import MasterOptimizer
from factory.runtime.run_state import restore_boundary
from factory.runtime.schedule import learning_rate
from factory.schemas.blueprint import Blueprint
from factory.schemas.program import resolve_program

DRIVER = Path(__file__).with_name("train_program_driver.py")
STAGES = ("phase1", "phase2", "sft")
STEPS = {"phase1": 4, "phase2": 4, "sft": 3}
EVERY = 2


def program_blueprint() -> Blueprint:
    """phase1 -> phase2 (one WSD schedule over both, its decay the last half: phase 2) -> SFT
    (cosine with warmup, restarted, fresh optimizer)."""
    data = tiny_blueprint().model_dump(mode="json", exclude_unset=True)
    data["training"]["schedule"] = {"kind": "wsd", "warmup_fraction": 0.25, "decay_fraction": 0.5}
    data["stages"] = [
        {"name": "phase1", "training": {"steps": STEPS["phase1"]}},
        {"name": "phase2", "continue_schedule": True, "training": {"steps": STEPS["phase2"]}},
        {
            "name": "sft",
            "carry": {"optimizer": False},
            "training": {
                "steps": STEPS["sft"],
                "schedule": {"kind": "cosine", "warmup_fraction": 0.34},
            },
        },
    ]
    return Blueprint.model_validate(data)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The program as a file (JSON is YAML) and DATA/<stage>/ for every stage: the tiny
    blueprint's shards (its recipe's chat sources carry loss masks)."""
    folder = tmp_path_factory.mktemp("program")
    blueprint = folder / "program.yaml"
    blueprint.write_text(
        json.dumps(program_blueprint().model_dump(mode="json", exclude_unset=True))
    )
    shards = build_shards(tiny_blueprint(), folder / "shards")
    data = folder / "data"
    data.mkdir()
    for name in STAGES:
        (data / name).symlink_to(shards)
    return blueprint, data


def _args(inputs: tuple[Path, Path], run: Path, *extra: str) -> list[str]:
    blueprint, data = inputs
    return ["train", str(blueprint), "--data", str(data), "--out", str(run),
            "--checkpoint-every", str(EVERY), *extra]  # fmt: skip


def _drive(tmp: Path, argv: list[str], kill: dict[str, int] | None = None) -> Any:
    spec = tmp / f"spec-{len(list(tmp.glob('spec-*')))}.json"
    spec.write_text(json.dumps({"argv": argv, "kill": kill or {}}))
    return subprocess.run([sys.executable, str(DRIVER), str(spec)], capture_output=True,
                          text=True, timeout=TIMEOUT, env=ENV)  # fmt: skip


def _program(run: Path) -> dict[str, Any]:
    return json.loads((run / "program.json").read_text())


@pytest.fixture(scope="module")
def reference(inputs: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("reference")
    done = _drive(tmp, _args(inputs, tmp / "run"))
    assert done.returncode == 0, done.stderr[-3000:]
    (tmp / "output.txt").write_text(done.stderr + done.stdout)
    return tmp / "run"


def test_the_program_trains_every_stage_into_one_run_folder(reference: Path) -> None:
    program = _program(reference)
    assert [s["name"] for s in program["stages"]] == list(STAGES)
    for entry in program["stages"]:
        name = entry["name"]
        assert entry["status"] == "completed" and entry["steps"] == STEPS[name]
        boundary = reference / entry["boundary"]["checkpoint"]
        assert boundary == reference / name / "checkpoints" / f"step_{STEPS[name]:08d}"
        assert (boundary / "meta.json").is_file()  # kept: nothing after it prunes it
        stage = reference / name
        assert (stage / "model" / "model.safetensors").is_file()
        summary = json.loads((stage / "train.json").read_text())
        assert summary["stage"] == name and summary["end"] == "completed"
        lines = records(stage)
        assert lines and all(r["stage"] == name for r in lines)
        assert sorted(losses(stage)) == list(range(STEPS[name]))
    # Each stage starts from the one before: phase 2 picks up a trained model.
    assert losses(reference / "phase2")[0] < losses(reference / "phase1")[0] - 1.0
    output = (reference.parent / "output.txt").read_text()
    assert f"train sft: step 1/{STEPS['sft']}" in output


def test_every_step_takes_the_rate_of_its_place_in_the_program(reference: Path) -> None:
    """lr(step s of a stage) = learning_rate(schedule_offset + s, schedule_steps, its
    training): phase 2 goes on with phase 1's WSD schedule, whose decay ends at min_lr on
    phase 2's last step; SFT warms up again."""
    program = resolve_program(program_blueprint())
    for stage in program:
        training = stage.blueprint.training
        got = [r["lr"] for r in records(reference / stage.name) if r["kind"] == "step"]
        want = [
            learning_rate(stage.schedule_offset + s, stage.schedule_steps, training)
            for s in range(stage.steps)
        ]
        assert got == want, stage.name
    phase1, phase2 = program.stage("phase1"), program.stage("phase2")
    assert (phase2.schedule_offset, phase2.schedule_steps) == (4, 8)
    peak, floor = phase1.blueprint.training.optimizer.lr, phase1.blueprint.training.optimizer.min_lr
    p1 = [r["lr"] for r in records(reference / "phase1") if r["kind"] == "step"]
    p2 = [r["lr"] for r in records(reference / "phase2") if r["kind"] == "step"]
    assert p1[-1] == peak and p2[0] < peak and p2[-1] == pytest.approx(floor)
    sft = [r["lr"] for r in records(reference / "sft") if r["kind"] == "step"]
    assert sft[0] < sft[1]  # a warmup of its own


def test_a_boundary_carries_the_optimizer_only_where_the_stage_says(reference: Path) -> None:
    """Phase 2 carries Adam's state on (its boundary's step count spans both phases); SFT
    starts a fresh optimizer (its boundary counts its own steps only)."""
    bp = resolve_program(program_blueprint()).stage("sft").blueprint
    for name, adam_steps in (("phase2", 8), ("sft", 3)):
        compiled = factory.compile(bp, seed=1, precision="emulate")
        optimizer = MasterOptimizer(compiled.model, bp.training.optimizer)
        boundary = reference / name / "checkpoints" / f"step_{STEPS[name]:08d}"
        restore_boundary(boundary, compiled, optimizer, with_optimizer=True)
        counts = {float(s["step"]) for s in optimizer.optimizer.state.values()}
        assert counts == {adam_steps}, name
    fresh = MasterOptimizer(compiled.model, bp.training.optimizer)
    restore_boundary(boundary, compiled, fresh, with_optimizer=False)
    assert not fresh.optimizer.state


def _same_program(run: Path, reference: Path) -> None:
    for name in STAGES:
        assert losses(run / name) == losses(reference / name), name  # bit for bit
    assert same_weights(run / "sft", reference / "sft")
    assert [s["status"] for s in _program(run)["stages"]] == ["completed"] * 3


@pytest.mark.parametrize(
    "kill",
    [
        pytest.param({"step": 7}, id="mid-stage-2"),  # after phase 2's step-2 checkpoint
        pytest.param({"step": 5}, id="boundary"),  # phase 1 done, phase 2 has no checkpoint
    ],
)
def test_a_killed_program_reruns_to_the_uninterrupted_result(
    inputs: tuple[Path, Path], reference: Path, tmp_path: Path, kill: dict[str, int]
) -> None:
    run = tmp_path / "run"
    killed = _drive(tmp_path, _args(inputs, run), kill)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    status = {s["name"]: s["status"] for s in _program(run)["stages"]}
    assert status["sft"] == "pending"
    rerun = _drive(tmp_path, _args(inputs, run))
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    _same_program(run, reference)


def test_a_sigterm_in_stage_2_stops_there_and_the_rerun_ends_the_same(
    inputs: tuple[Path, Path], reference: Path, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    args = [sys.executable, "-m", "factory", *_args(inputs, run)]
    status, output = signalled(args, run / "phase2", signal.SIGTERM)
    assert status == 128 + signal.SIGTERM, output[-3000:]
    assert "rerun the same command to resume" in output
    assert {s["name"]: s["status"] for s in _program(run)["stages"]} == {
        "phase1": "completed", "phase2": "interrupted", "sft": "pending",
    }  # fmt: skip
    rerun = subprocess.run(args, capture_output=True, text=True, timeout=TIMEOUT, env=ENV)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    _same_program(run, reference)


def test_one_launch_of_two_ranks_trains_every_stage(
    inputs: tuple[Path, Path], tmp_path: Path
) -> None:
    """The stages of one ``--nproc 2`` launch share its process group (torch names a group
    made again after one was destroyed as the first, and the new one hung on the old one's
    keys in torchrun's store)."""
    run = tmp_path / "run"
    done = _cli(*_args(inputs, run, *TWO_RANKS))
    assert done.returncode == 0, done.stderr[-3000:]
    assert [s["status"] for s in _program(run)["stages"]] == ["completed"] * 3
    for name in STAGES:
        assert sorted(losses(run / name)) == list(range(STEPS[name]))
        assert (run / name / "ranks" / "rank_00001.jsonl").is_file()


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "factory", *args], capture_output=True,
                          text=True, timeout=TIMEOUT, env=ENV)  # fmt: skip


def test_stage_refuses_a_name_the_program_lacks_and_a_stage_out_of_order(
    inputs: tuple[Path, Path], tmp_path: Path
) -> None:
    run = tmp_path / "run"
    unknown = _cli(*_args(inputs, run, "--stage", "phase-2"))
    assert unknown.returncode == 2, unknown.stderr
    assert "--stage phase-2: no such stage; the program has phase1, phase2, sft" in unknown.stderr
    assert "(did you mean 'phase2'?)" in unknown.stderr
    early = _cli(*_args(inputs, run, "--stage", "sft"))
    assert early.returncode == 2, early.stderr
    assert "stage 'phase2' before it has no boundary checkpoint yet" in early.stderr
    assert not run.exists()  # refused before anything was written
    data = inputs[1]
    flat = tmp_path / "flat.yaml"
    flat.write_text(json.dumps(tiny_blueprint().model_dump(mode="json")))
    single = _cli(*_args((flat, data / "phase1"), run, "--stage", "phase1"))
    assert single.returncode == 2 and "has no stages" in single.stderr


def test_a_stage_carrying_the_data_position_reads_on_in_the_shards_before(
    inputs: tuple[Path, Path], tmp_path: Path
) -> None:
    """With ``carry.data_position`` stage 2 trains on stage 1's shards from where stage 1
    stopped (its boundary's position), not from their start."""
    data = program_blueprint().model_dump(mode="json", exclude_unset=True)
    data["stages"] = [
        {"name": "phase1", "training": {"steps": 2}},
        {"name": "phase2", "carry": {"data_position": True}, "training": {"steps": 2}},
    ]
    run = tmp_path / "run"
    factory.train(Blueprint.model_validate(data), out=run, data=inputs[1], precision="off")
    per_stage = 2 * tiny_blueprint().parallelism.global_batch_size  # samples of 2 steps

    def consumed(stage: str) -> int:
        meta = json.loads((run / stage / "checkpoints" / "step_00000002" / "meta.json").read_text())
        return meta["data"]["consumed"]

    assert (consumed("phase1"), consumed("phase2")) == (per_stage, 2 * per_stage)
    phase2 = json.loads((run / "phase2" / "train.json").read_text())
    assert phase2["data"] == str(inputs[1] / "phase1")  # the shards it read on in
