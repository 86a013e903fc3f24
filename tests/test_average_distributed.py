"""``training.average`` on two gloo processes: sharded by FSDP, or split by TP with its
rank-major Mamba projections, it is the one-process average (test_average_training.py has
the rest)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from average_helpers import (
    START,
    STEPS,
    blueprint,
    expected_average,
    read,
    same_state,
    train,
)

from factory.distributed.local import run_ranks
from factory.runtime.averaging import AVERAGE, MODEL
from factory.runtime.batches import build_shards
from factory.schemas.blueprint import Blueprint


def _train_rank(rank: int, world: int, bp: Blueprint, out: Path, data: Path) -> None:
    train(bp, out, data)


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_shards(blueprint(), tmp_path_factory.mktemp("average-data"))


@pytest.fixture(scope="module")
def averaged_run(data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train(blueprint(), tmp_path_factory.mktemp("one-process") / "run", data)


@pytest.mark.parametrize(
    "parallelism",
    [
        pytest.param({}, id="dp2-fsdp"),
        pytest.param({"tp": 2, "sequence_parallel": True, "etp": 1}, id="tp2-sp"),
    ],
)
def test_the_average_on_two_processes_is_the_one_process_average(
    parallelism: dict[str, Any], averaged_run: Path, data: Path, tmp_path: Path
):
    """Sharded (FSDP) or split with TP's rank-major Mamba projections, the average follows the
    formula bit for bit over that run's own masters; so it is one process's average but for
    the rounding in which the layouts' masters differ: a convex combination of them, it is
    never further from one process's than the furthest of the masters it averages (give or
    take its own rounding)."""
    run_ranks(_train_rank, 2, blueprint(2, **parallelism), tmp_path, data, timeout=240)
    final = f"checkpoints/step_{STEPS:08d}"
    assert same_state(read(tmp_path / final, AVERAGE), expected_average(tmp_path))
    got, want = read(tmp_path / final, AVERAGE), read(averaged_run / final, AVERAGE)
    furthest = dict.fromkeys(want, 0.0)
    for step in range(START + 1, STEPS + 1):
        ours = read(tmp_path / "checkpoints" / f"step_{step:08d}", MODEL)
        theirs = read(averaged_run / "checkpoints" / f"step_{step:08d}", MODEL)
        for name in want:
            furthest[name] = max(furthest[name], (ours[name] - theirs[name]).abs().max().item())
    for name, tensor in want.items():
        apart = (got[name] - tensor).abs().max().item()
        scale = max(tensor.abs().max().item(), 1e-6)
        # The average's own fp32 rounding (a few ulps of the tensor) comes on top.
        assert apart <= furthest[name] + 1e-6 * scale, name
        assert apart <= 1e-2 * scale, name
