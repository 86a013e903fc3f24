"""Launching a layout: refusals before any process starts, and a rank that dies mid-run.

The refusals run in-process through the CLI. The fault test starts
``factory train --nproc 2`` (torchrun, two gloo ranks), SIGKILLs rank 1 once
rank 0 has logged its first step, and checks that the launch ends, failing,
within the timeout and names the rank that died (torchrun's record of the
first failure; whether rank 0 prints its own line first is a race).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
import torch.distributed.run as torchrun
from preset_stages import stage_alone
from rich.console import Console
from runtime_helpers import tiny_blueprint
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from factory.cli import train_cmd
from factory.jobs.launch import torchrun_args
from factory.loading.blueprint import resolve_source
from factory.runtime.batches import build_shards

SUPER = resolve_source("super")

DP_ONLY = ["--set", "parallelism.tp=1", "--set", "parallelism.ep=1",
           "--set", "parallelism.sequence_parallel=false"]  # fmt: skip


def test_a_launch_whose_size_differs_from_the_layout_exits_2_naming_both(
    cli: Callable[..., tuple[int, str, str]],
) -> None:
    status, _, err = cli("train", "super", "--nproc", "2")
    assert status == 2
    line = next(n for n, text in enumerate(SUPER.read_text().splitlines(), 1)
                if text.strip().startswith("world_size:"))  # fmt: skip
    where, _, rest = err.partition(f":{line}: ")  # the file is shown relative to the cwd
    assert Path(where).resolve() == SUPER.resolve(), err
    # Super is a program: the launch is its first stage's, which the refusal names
    assert rest.startswith("parallelism.world_size: stage phase1: 2 processes"), err
    assert "parallelism.world_size=64" in err and "--set parallelism.world_size=2" in err


def test_context_parallelism_across_pipeline_stages_is_refused_before_launch(
    cli: Callable[..., tuple[int, str, str]],
) -> None:
    status, _, err = cli(
        "train", "nano", "--nproc", "64", "--set", "parallelism.world_size=64",
        "--set", "parallelism.cp=2", "--set", "parallelism.pp=2",
    )  # fmt: skip
    assert status == 2
    # the overrides reach Nano's pretraining stages, whose launch comes first
    refusal = ": parallelism.cp: stage phase1: parallelism.cp=2 with pp=2: factory's runtime"
    assert refusal in err, err
    assert "parallelism.pp=1" in err
    # validate's rule, named; its warning is not printed before the refusal that repeats it
    assert err.count("cp=2 with pp=2") == 1 and "[runtime.context_across_stages]" in err, err


def test_transformer_engine_under_tensor_parallelism_is_refused_before_launch(
    cli: Callable[..., tuple[int, str, str]],
) -> None:
    status, _, err = cli("train", "super", "--nproc", "64", "--precision", "te")
    assert status == 2
    assert ": parallelism.tp: stage phase1: --precision te with parallelism.tp=2:" in err, err
    assert "--precision emulate" in err


def _ranks_of(marker: str) -> dict[int, int]:
    """pid of each rank of the launch whose environment carries ``marker``."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            env = dict(
                item.split("=", 1)
                for item in (entry / "environ").read_bytes().decode(errors="replace").split("\0")
                if "=" in item
            )
        except OSError:
            continue
        if env.get("FACTORY_TEST_LAUNCH") == marker and "LOCAL_RANK" in env:
            found[int(env["RANK"])] = int(entry.name)
    return found


def _first_step_logged(run: Path) -> bool:
    metrics = run / "metrics.jsonl"
    if not metrics.is_file():
        return False
    return any(json.loads(line)["kind"] == "step" for line in metrics.read_text().splitlines())


@pytest.mark.skipif(not Path("/proc/self/environ").is_file(), reason="needs Linux /proc")
def test_a_rank_that_dies_ends_the_launch_naming_it(tmp_path: Path) -> None:
    data = build_shards(tiny_blueprint(), tmp_path / "data")
    run, marker = tmp_path / "run", uuid.uuid4().hex
    env = {**os.environ, "FACTORY_TEST_LAUNCH": marker, "FACTORY_COLLECTIVE_TIMEOUT_S": "60"}
    # Super's phase 1 alone: one run folder, and DP_ONLY leaves the later stages' tp=2
    # without sequence parallelism
    phase1 = stage_alone("super", "phase1", tmp_path)
    command = [sys.executable, "-m", "factory", "train", str(phase1), "--proxy", "--nproc", "2",
               "--steps", "200", "--data", str(data), "--out", str(run), *DP_ONLY]  # fmt: skip
    launch = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 240
        while not _first_step_logged(run):
            assert launch.poll() is None, launch.stdout.read().decode()  # type: ignore[union-attr]
            assert time.monotonic() < deadline, "no step within 240 s"
            time.sleep(0.5)
        os.kill(_ranks_of(marker)[1], signal.SIGKILL)
        output, _ = launch.communicate(timeout=180)  # a hang fails here
    finally:
        if launch.poll() is None:
            launch.kill()
    text = output.decode(errors="replace")
    assert launch.returncode != 0
    assert "rank 1 failed first (signal 9)" in text, text[-3000:]
    # Rank 0 says "another rank has died or stopped answering" when its collective fails
    # first; when torchrun's SIGTERM reaches it first it says nothing. Either way, no crash.
    assert "internal error" not in text


def _failure(exitcode: int, timestamp: int) -> ProcessFailure:
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=exitcode, error_file="")
    failure.timestamp = timestamp
    return failure


def test_the_rank_named_first_is_the_cause_not_a_rank_that_lost_it() -> None:
    lost, killed = train_cmd.EXIT_RANK_LOST, -signal.SIGKILL
    # The same second: torchrun's own choice would be rank 0, which only lost rank 1.
    rank, how = train_cmd._root_failure({0: _failure(lost, 100), 1: _failure(killed, 100)})
    assert (rank, how.exitcode) == (1, killed)
    # Two causes: the earlier; and when every rank only lost another, the earliest of them.
    causes = {0: _failure(1, 101), 1: _failure(killed, 102), 2: _failure(lost, 99)}
    assert train_cmd._root_failure(causes)[0] == 0
    assert train_cmd._root_failure({0: _failure(lost, 101), 3: _failure(lost, 100)})[0] == 3


def test_a_refusal_under_torchrun_is_our_line_once_and_the_root_cause_torchrun_names(
    tmp_path: Path,
) -> None:
    """torchrun ends every launch with a failed worker in its own traceback and summary; the
    refusal is printed once (rank 0), every rank exits 2, and the summary's root cause carries
    the same line instead of a link to torchelastic's documentation."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node", "2", "-m", "factory", "train", "super", "--steps", "1",
               "--out", str(tmp_path / "run")]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    lines = (done.stdout + done.stderr).splitlines()
    refusal = "parallelism.world_size: stage phase1: 2 processes"  # Super's first stage
    ours = [n for n, line in enumerate(lines) if refusal in line]
    printed = [n for n in ours if not lines[n].startswith(" ")]  # not inside the summary
    assert len(printed) == 1, "\n".join(lines[-60:])
    summary = [line for line in lines if line.strip().startswith("traceback")]
    root_cause = summary[-1].split(":", 1)[1].strip()
    assert root_cause == lines[printed[0]], "\n".join(lines[-60:])
    assert "internal error" not in done.stderr
    assert not (tmp_path / "run").exists()


def test_the_launcher_gives_the_ranks_time_to_checkpoint_after_a_signal(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """torchrun kills the ranks 30 s after it passes a SIGTERM on, by default: less than a
    large model's checkpoint takes. ``factory train --nproc`` waits FACTORY_SHUTDOWN_GRACE_S."""
    seen = []
    monkeypatch.setattr(torchrun, "run", seen.append)
    monkeypatch.setenv("FACTORY_SHUTDOWN_GRACE_S", "123")
    assert train_cmd._torchrun(torchrun_args(2, ["train", "nano"]), Console()) == 0
    assert seen[0].shutdown_timeout == 123
