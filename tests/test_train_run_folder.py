"""The run folder survives what happens to it: a second training, a damaged checkpoint, a torn
line of metrics.jsonl, a full disk. Each ends in one line naming the file and the cause (no
traceback), and the rerun continues exactly as a run that never stopped.

``factory train`` runs in child processes on the tiny runtime blueprint
(``train_cli_helpers``); a finished run (24 steps, checkpoints every 4, the last
three kept) is the reference the others are compared with, step for step and
weight for weight.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import signal
import sys
from pathlib import Path

import pytest
import torch
from runtime_helpers import tiny_blueprint
from train_cli_helpers import (
    STEPS,
    TWO_RANKS,
    losses,
    records,
    run,
    same_weights,
    start_and_wait_for_a_step,
    tiny_run_inputs,
    train_args,
)

FULL_DISK_DRIVER = Path(__file__).with_name("full_disk_driver.py")


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return tiny_run_inputs(tmp_path_factory.mktemp("run-folder"))


@pytest.fixture(scope="module")
def reference(inputs: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    done = run(train_args(inputs, run_dir))
    assert done.returncode == 0, done.stderr
    assert sorted(losses(run_dir)) == list(range(STEPS))
    return run_dir


def _unfinished_copy(reference: Path, tmp_path: Path) -> Path:
    """The reference run as it stood before its export: its checkpoints and metrics."""
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    for name in ("model", "report"):
        shutil.rmtree(run_dir / name)
    (run_dir / "train.json").unlink()
    return run_dir


def _clean(output: str) -> None:
    assert "Traceback" not in output and "internal error" not in output, output[-3000:]


def _tree(path: Path) -> dict[str, tuple[bytes, int]]:
    """Every file under ``path`` but the run's lock (each run takes it): bytes and mtime."""
    return {
        str(f.relative_to(path)): (f.read_bytes(), f.stat().st_mtime_ns)
        for f in sorted(path.rglob("*"))
        if f.is_file() and f.name != ".lock"
    }


@pytest.mark.parametrize("ranks", [(), TWO_RANKS], ids=["one-process", "two-ranks"])
def test_a_rerun_of_a_finished_run_says_so_and_changes_nothing(
    inputs: tuple[Path, Path], reference: Path, tmp_path: Path, ranks: tuple[str, ...]
) -> None:
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    before = _tree(run_dir)
    rerun = run(train_args(inputs, run_dir, *ranks))
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    said = [line for line in rerun.stderr.splitlines() if line.startswith("factory train:")]
    assert said == [
        f"factory train: super-proxy already complete at step {STEPS} ({run_dir}); nothing to do"
    ], rerun.stderr[-3000:]
    _clean(rerun.stderr)
    after = _tree(run_dir)
    assert after["metrics.jsonl"] == before["metrics.jsonl"]  # no second run or end line
    assert after == before  # no checkpoint saved again, model/ and the report untouched


def test_a_rerun_after_the_last_checkpoint_exports_without_saving_it_again(
    inputs: tuple[Path, Path], reference: Path, tmp_path: Path
) -> None:
    run_dir = _unfinished_copy(reference, tmp_path)  # killed between its last save and export
    checkpoints = _tree(run_dir / "checkpoints")
    rerun = run(train_args(inputs, run_dir))
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert _tree(run_dir / "checkpoints") == checkpoints
    assert same_weights(run_dir, reference)
    saved = [r["step"] for r in records(run_dir) if r["kind"] == "checkpoint"]
    assert saved == [r["step"] for r in records(reference) if r["kind"] == "checkpoint"]


def test_a_second_training_into_the_folder_is_refused_naming_the_holder(
    inputs: tuple[Path, Path], tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    first = start_and_wait_for_a_step(
        train_args(inputs, run_dir, steps=100_000, every=100_000), run_dir
    )
    try:
        for extra in ((), TWO_RANKS):  # refused by the run itself, or by the launcher
            second = run(train_args(inputs, run_dir, *extra))
            assert second.returncode == 2, second.stderr[-3000:]
            assert second.stderr.strip().splitlines()[-1] == (
                f"factory train: {run_dir}: another training is writing this run folder "
                f"(pid {first.pid}); wait for it to end, or train into another folder"
            )
            _clean(second.stderr)
        assert first.poll() is None  # the first run goes on, undisturbed
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    kinds = [r["kind"] for r in records(run_dir)]
    assert kinds.count("run") == 1  # the refused runs wrote nothing
    # The kernel dropped the killed run's lock: the rerun is not blocked by it.
    shutil.rmtree(run_dir / "checkpoints")
    rerun = run(train_args(inputs, run_dir))
    assert rerun.returncode == 0, rerun.stderr[-3000:]


def test_a_damaged_newest_checkpoint_falls_back_to_the_one_before(
    inputs: tuple[Path, Path], reference: Path, tmp_path: Path
) -> None:
    run_dir = _unfinished_copy(reference, tmp_path)
    newest = run_dir / "checkpoints" / f"step_{STEPS:08d}"
    shard = next(newest.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    rerun = run(train_args(inputs, run_dir))
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    said = [line for line in rerun.stderr.splitlines() if "cannot be read" in line]
    assert len(said) == 1, rerun.stderr
    assert said[0].startswith(f"factory train: {newest}: cannot be read (")
    aside = f"step_{STEPS:08d}.damaged"
    assert said[0].endswith(f"; moved to {aside}; resuming from step_{STEPS - 4:08d}")
    assert (run_dir / "checkpoints" / aside / shard.name).is_file()  # kept for a look
    _clean(rerun.stderr)
    assert records(run_dir)[-1]["kind"] == "end"
    assert losses(run_dir) == losses(reference)  # steps 20-23 again, bit for bit
    assert same_weights(run_dir, reference)


def test_no_readable_checkpoint_is_one_line_and_exit_2(
    inputs: tuple[Path, Path], reference: Path, tmp_path: Path
) -> None:
    run_dir = _unfinished_copy(reference, tmp_path)
    for checkpoint in (run_dir / "checkpoints").glob("step_*"):
        (checkpoint / "rank0.pt").write_bytes(b"not a pickle")
    rerun = run(train_args(inputs, run_dir))
    assert rerun.returncode == 2
    last = rerun.stderr.strip().splitlines()[-1]
    assert last.startswith(f"factory train: {run_dir}/checkpoints/step_{STEPS:08d}: cannot be")
    assert last.count("cannot be read") == 3 and last.endswith("no checkpoint left to resume from")
    _clean(rerun.stderr)
    assert len(list((run_dir / "checkpoints").glob("step_*[0-9]"))) == 3  # none moved aside


class _RunsCode:
    """Unpickled, it makes the folder ``marker``: proof that the pickle's code ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (os.mkdir, (str(self.marker),))


def test_checkpoints_whose_pickles_would_run_code_are_passed_over_and_none_runs(
    inputs: tuple[Path, Path], reference: Path, tmp_path: Path
) -> None:
    """A run folder someone else could write: the newest checkpoint's rank file and the next
    one's DCP metadata are replaced by pickles that would run code. Each is a checkpoint that
    cannot be read, refused unread; the run resumes from the third, bit for bit."""
    run_dir = _unfinished_copy(reference, tmp_path)
    marker = tmp_path / "code-ran"
    newest, before = (run_dir / "checkpoints" / f"step_{s:08d}" for s in (STEPS, STEPS - 4))
    with open(newest / "rank0.pt", "wb") as handle:
        torch.save({"rng": _RunsCode(marker)}, handle)
    (before / ".metadata").write_bytes(pickle.dumps(_RunsCode(marker)))
    rerun = run(train_args(inputs, run_dir))
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert not marker.exists()
    said = [line for line in rerun.stderr.splitlines() if "cannot be read" in line]
    assert len(said) == 2, rerun.stderr
    assert said[0].startswith(f"factory train: {newest}: cannot be read (UnpicklingError: ")
    assert "rank0.pt holds more than tensors, numbers, strings, lists and dicts" in said[0]
    assert said[1].startswith(f"factory train: {before}: cannot be read (UnpicklingError: ")
    assert ".metadata names posix.mkdir, which no DCP metadata holds: refused unread" in said[1]
    assert said[1].endswith(f"resuming from step_{STEPS - 8:08d}")
    _clean(rerun.stderr)
    assert losses(run_dir) == losses(reference)
    assert same_weights(run_dir, reference)


def test_a_torn_last_line_of_the_metrics_is_cut_before_the_rerun_appends(
    inputs: tuple[Path, Path], reference: Path, tmp_path: Path, cli
) -> None:
    run_dir = _unfinished_copy(reference, tmp_path)
    shutil.rmtree(run_dir / "checkpoints" / f"step_{STEPS:08d}")  # killed before it
    metrics = run_dir / "metrics.jsonl"
    torn = '{"kind": "step", "update": 2'
    with metrics.open("a") as handle:
        handle.write(torn)
    rerun = run(train_args(inputs, run_dir))
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert (
        f"factory train: {metrics}: removed a torn last line ({len(torn)} bytes, from a run "
        "killed while writing it) before appending"
    ) in rerun.stderr.splitlines()
    for line in metrics.read_text().splitlines():
        json.loads(line)
    status, _, err = cli("report", str(run_dir))
    assert status == 0, err
    assert losses(run_dir) == losses(reference)


def test_a_full_disk_during_a_checkpoint_is_one_line_and_the_rerun_resumes(
    inputs: tuple[Path, Path], reference: Path, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    tmp_name = ".step_00000008.tmp"
    args = train_args(inputs, run_dir)
    full = run([sys.executable, str(FULL_DISK_DRIVER), tmp_name, *args[3:]])
    assert full.returncode == 1, full.stderr[-3000:]
    tmp = run_dir / "checkpoints" / tmp_name
    last = full.stderr.strip().splitlines()[-1]
    assert last.startswith(f"factory train: {tmp}: the disk is full ("), full.stderr[-3000:]
    assert "the checkpoint of step 8 was not written" in last
    _clean(full.stderr)
    assert not tmp.exists()
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_00000004"]
    rerun = run(args)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert [r["resumed_at"] for r in records(run_dir) if r["kind"] == "run"] == [0, 4]
    assert losses(run_dir) == losses(reference)
    assert same_weights(run_dir, reference)


@pytest.mark.parametrize("ranks", [(), TWO_RANKS], ids=["one-process", "two-ranks"])
def test_a_recipe_that_curates_to_nothing_is_refused_on_every_rank(
    tmp_path: Path, ranks: tuple[str, ...]
) -> None:
    """The run builds its blueprint's recipe into RUN/data on rank 0: when nothing survives,
    every rank stops at once with the build's one line (the others must not sit at the
    barrier until the process group times out)."""
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.jsonl").write_text("")
    recipe = tmp_path / "empty.yaml"
    recipe.write_text(
        "name: empty\nsources:\n  - {name: web, path: in, category: pretrain_text, weight: 1,"
        " steps: [{kind: text}]}\n"
    )
    data = tiny_blueprint().model_dump(mode="json")
    data["data"]["recipe"] = str(recipe)
    blueprint = tmp_path / "tiny.yaml"
    blueprint.write_text(json.dumps(data))
    args = [sys.executable, "-m", "factory", "train", str(blueprint), "--out",
            str(tmp_path / "run"), "--steps", "2", *ranks]  # fmt: skip
    done = run(args)
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("factory train:")]
    assert len(lines) == 1 and "no documents survived curation" in lines[0], done.stderr
    assert "Traceback" not in done.stderr.split("ChildFailedError")[0]
    assert "internal error" not in done.stderr
