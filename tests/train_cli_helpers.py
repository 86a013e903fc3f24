"""Run ``factory train`` on the tiny runtime blueprint in child processes, and read what it wrote.

Shared by the tests of how a run stops, refuses and resumes (test_train_stops.py,
test_train_run_folder.py). Every child runs on one thread, so that two runs
reduce in the same order and an exact resume is bit for bit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
from runtime_helpers import tiny_blueprint

from factory.graph.weights import read_state_dict
from factory.runtime.batches import build_shards

STEPS = 24
"""Long enough that a signal sent after the first step arrives mid-run (a step takes a tenth
of a second, the run several)."""
EVERY = 4
TIMEOUT = 300
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "400"}
TWO_RANKS = ("--nproc", "2", "--set", "parallelism.world_size=2")


def tiny_run_inputs(folder: Path) -> tuple[Path, Path]:
    """The tiny blueprint as a file (JSON is YAML) and its shards."""
    folder.mkdir(parents=True, exist_ok=True)
    blueprint = folder / "tiny.yaml"
    blueprint.write_text(json.dumps(tiny_blueprint().model_dump(mode="json")))
    return blueprint, build_shards(tiny_blueprint(), folder / "data")


def train_args(
    inputs: tuple[Path, Path], run: Path, *extra: str, steps: int = STEPS, every: int = EVERY
) -> list[str]:
    blueprint, data = inputs
    return [sys.executable, "-m", "factory", "train", str(blueprint), "--data", str(data),
            "--out", str(run), "--steps", str(steps), "--checkpoint-every", str(every),
            *extra]  # fmt: skip


def run(args: list[str], **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=TIMEOUT, env={**ENV, **env})


def steps_logged(run_dir: Path) -> int:
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        return 0
    return metrics.read_text().count('"kind": "step"')


def start_and_wait_for_a_step(args: list[str], run_dir: Path) -> subprocess.Popen:
    """Start ``args`` and return once it has logged its first step."""
    child = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=ENV)
    deadline = time.monotonic() + TIMEOUT
    while not steps_logged(run_dir):
        if child.poll() is not None or time.monotonic() > deadline:
            child.kill()
            raise AssertionError(child.communicate()[0].decode(errors="replace"))
        time.sleep(0.02)
    return child


def signalled(args: list[str], run_dir: Path, *signums: int) -> tuple[int, str]:
    """Run ``args``, send ``signums`` after its first step; its exit status and output."""
    child = start_and_wait_for_a_step(args, run_dir)
    for signum in signums:
        os.kill(child.pid, signum)
    output, _ = child.communicate(timeout=TIMEOUT)
    return child.returncode, output.decode(errors="replace")


def records(run: Path) -> list[dict]:
    """The records of a run folder's metrics.jsonl, or of the .jsonl file ``run``."""
    path = run if run.suffix == ".jsonl" else run / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def losses(run_dir: Path) -> dict[int, float]:
    """Every step's loss, the last record of a step winning (a resume re-runs no step, but a
    damaged checkpoint's fallback does)."""
    return {r["step"]: r["loss"] for r in records(run_dir) if r["kind"] == "step"}


def same_weights(run_a: Path, run_b: Path) -> bool:
    a, b = read_state_dict(run_a / "model"), read_state_dict(run_b / "model")
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
