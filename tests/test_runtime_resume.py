"""Exact resume: a run killed with SIGKILL anywhere and resumed gives, step for step, the same
loss as a run that never stopped (fp32 on CPU: bitwise), and bad checkpoints are refused."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from runtime_helpers import STEPS, tiny_blueprint

from factory.runtime.batches import build_shards

DRIVER = Path(__file__).with_name("runtime_driver.py")
TIMEOUT = 240


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_shards(tiny_blueprint(), tmp_path_factory.mktemp("resume-data"))


def _run(tmp: Path, data: Path, run_dir: Path, **spec: Any) -> subprocess.CompletedProcess:
    full = {
        "blueprint": tiny_blueprint().model_dump(mode="json"),
        "data": str(data),
        "run_dir": str(run_dir),
        "steps": STEPS,
        **spec,
    }
    path = tmp / f"spec-{len(list(tmp.glob('spec-*')))}.json"
    path.write_text(json.dumps(full))
    return subprocess.run(
        [sys.executable, str(DRIVER), str(path)], capture_output=True, text=True, timeout=TIMEOUT
    )


def _losses(run_dir: Path) -> dict[int, float]:
    """The loss of every step, the last record of a step winning (a step re-run after a
    resume replaces the one cut short)."""
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            if record["kind"] == "step":
                out[record["step"]] = record["loss"]
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, data: Path) -> dict[int, float]:
    tmp = tmp_path_factory.mktemp("reference")
    done = _run(tmp, data, tmp / "run")
    assert done.returncode == 0, done.stderr
    losses = _losses(tmp / "run")
    assert sorted(losses) == list(range(STEPS))
    return losses


@pytest.mark.parametrize(
    ("kill", "mode"),
    [
        ({"step": 4}, "sync"),  # mid-step, after a checkpoint at step 2
        ({"step": 7}, "sync"),  # mid-step, after the checkpoint at step 6
        ({"checkpoint": 2}, "sync"),  # while writing the step-4 checkpoint
        ({"checkpoint": 2}, "async"),  # while the background write of step 4 completes
    ],
)
def test_killed_and_resumed_run_matches_the_uninterrupted_one(
    tmp_path: Path, data: Path, reference: dict[int, float], kill: dict, mode: str
) -> None:
    run_dir = tmp_path / "run"
    killed = _run(tmp_path, data, run_dir, kill=kill, **{"async": mode == "async"})
    assert killed.returncode == -9, killed.stderr  # SIGKILL
    leftovers = list((run_dir / "checkpoints").glob(".step_*.tmp"))
    assert leftovers or "step" in kill  # a checkpoint cut short stays a temporary folder
    resumed = _run(tmp_path, data, run_dir, resume=True, **{"async": mode == "async"})
    assert resumed.returncode == 0, resumed.stderr
    assert _losses(run_dir) == reference  # every step, bit for bit
    assert not list((run_dir / "checkpoints").glob(".step_*.tmp"))


def test_resume_with_nothing_to_resume_is_an_error(tmp_path: Path, data: Path) -> None:
    done = _run(tmp_path, data, tmp_path / "empty", resume=True)
    assert done.returncode != 0 and "no complete checkpoint to resume from" in done.stderr
