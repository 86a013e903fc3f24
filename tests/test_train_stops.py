"""A run stopped by SIGTERM or SIGINT checkpoints where it stands, says so and resumes exactly.

``factory train`` runs in a child process, as Slurm or Kubernetes would run it;
the signal is sent once the run has logged a step. The rerun must give every
step's loss and the final weights of a run that never stopped (one thread per
process: bit for bit). The same on two ranks under ``--nproc 2``, where the
signal reaches the launcher and torchrun passes it on to the ranks.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from train_cli_helpers import (
    STEPS,
    TIMEOUT,
    TWO_RANKS,
    losses,
    records,
    run,
    same_weights,
    signalled,
    start_and_wait_for_a_step,
    tiny_run_inputs,
    train_args,
)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return tiny_run_inputs(tmp_path_factory.mktemp("stops"))


def _reference(inputs: tuple[Path, Path], folder: Path, *extra: str) -> Path:
    done = run(train_args(inputs, folder / "run", *extra))
    assert done.returncode == 0, done.stderr
    assert sorted(losses(folder / "run")) == list(range(STEPS))
    return folder / "run"


@pytest.fixture(scope="module")
def reference(inputs: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _reference(inputs, tmp_path_factory.mktemp("reference"))


def _stop_and_resume(
    inputs: tuple[Path, Path], run_dir: Path, signum: signal.Signals, *extra: str
) -> str:
    """Stop a run with ``signum``, check how it stopped, rerun it; the stop's output."""
    status, output = signalled(train_args(inputs, run_dir, *extra), run_dir, signum)
    assert status == 128 + signum, output[-3000:]
    last = output.strip().splitlines()[-1]
    end = records(run_dir)[-1]
    step = end["step"]
    assert 0 < step < STEPS, output[-3000:]  # mid-run
    checkpoint = run_dir / "checkpoints" / f"step_{step:08d}"
    assert last == (
        f"factory train: stopped by {signum.name} at step {step}; checkpoint {checkpoint}; "
        "rerun the same command to resume"
    )
    assert end["kind"] == "end" and end["reason"] == "interrupted"
    assert signum.name in end["message"]
    assert (checkpoint / "meta.json").is_file()  # at the step reached, not the last periodic one
    assert "Traceback" not in output and "internal error" not in output
    assert not (run_dir / "model").exists()  # a stopped run exports nothing
    resumed = run(train_args(inputs, run_dir, *extra))
    assert resumed.returncode == 0, resumed.stderr
    return output


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_checkpoints_stops_and_the_rerun_resumes_exactly(
    inputs: tuple[Path, Path], reference: Path, tmp_path: Path, signum: signal.Signals
) -> None:
    run_dir = tmp_path / "run"
    _stop_and_resume(inputs, run_dir, signum)
    assert losses(run_dir) == losses(reference)  # every step, bit for bit
    assert same_weights(run_dir, reference)


def test_a_second_signal_ends_the_run_at_once(inputs: tuple[Path, Path], tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    child = start_and_wait_for_a_step(train_args(inputs, run_dir), run_dir)
    # Both arrive while the child is stopped, so it cannot finish its stop between the two.
    os.kill(child.pid, signal.SIGSTOP)
    os.kill(child.pid, signal.SIGTERM)
    os.kill(child.pid, signal.SIGINT)
    os.kill(child.pid, signal.SIGCONT)
    output = child.communicate(timeout=TIMEOUT)[0].decode(errors="replace")
    status = child.returncode
    # Whichever of the two Python handles second ends the process as its default action would.
    assert status in (-signal.SIGTERM, -signal.SIGINT), output[-3000:]
    assert "Traceback" not in output
    assert records(run_dir)[-1]["kind"] != "end"


def test_two_ranks_stop_at_the_same_step_and_resume_exactly(
    inputs: tuple[Path, Path], tmp_path: Path
) -> None:
    reference = _reference(inputs, tmp_path / "reference", *TWO_RANKS)
    run_dir = tmp_path / "run"
    output = _stop_and_resume(inputs, run_dir, signal.SIGTERM, *TWO_RANKS)
    assert output.count("factory train: stopped by SIGTERM") == 1  # rank 0 alone says it
    stops = [
        next((r["step"], r["reason"]) for r in records(path) if r["kind"] == "end")
        for path in (run_dir / "metrics.jsonl", run_dir / "ranks" / "rank_00001.jsonl")
    ]
    assert stops[0] == stops[1] and stops[0][1] == "interrupted"
    assert losses(run_dir) == losses(reference)
    assert same_weights(run_dir, reference)
