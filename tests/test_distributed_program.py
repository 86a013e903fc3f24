"""A program's stage on another layout starts from the stage before's boundary checkpoint.

Phase 1 trains on one process; phase 2 declares tensor parallelism (TP=2 with sequence
parallelism, on 2 gloo processes), so its start reads phase 1's final checkpoint (weights,
fp32 masters and Adam's state, through DCP) onto a layout that did not write it. It must
train as the one-process continuation of the same phase 1 does, within the tolerances of
``test_distributed_train.py`` (fp32, lr 1e-3: losses to 1e-5 relative, weights to 1e-3 of
each tensor's largest entry).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from runtime_helpers import GLOBAL, tiny_blueprint
from safetensors.torch import load_file

import factory
from factory.distributed.local import run_ranks
from factory.runtime.batches import build_shards
from factory.schemas.blueprint import Blueprint

STEPS = 3
LOSS_RTOL, WEIGHT_TOL, LR = 1e-5, 1e-3, 1e-3
TP2 = {"world_size": 2, "tp": 2, "sequence_parallel": True, "etp": 1}


def _program(phase2_layout: dict[str, Any]) -> Blueprint:
    """Two stages of the tiny blueprint in fp32-friendly settings (no aux loss: with sequence
    parallelism each TP rank's would see half of each sequence)."""
    bp = tiny_blueprint(
        parallelism={"global_batch_size": 2 * GLOBAL},
        training={"steps": STEPS, "optimizer": {"lr": LR, "min_lr": LR / 10}},
    )
    data = bp.model_dump(mode="json", exclude_unset=True)
    data["model"]["moe"].setdefault("router", {})["aux_loss"] = "none"
    data["stages"] = [
        {"name": "phase1"},
        {"name": "phase2", "continue_schedule": True, "parallelism": phase2_layout},
    ]
    return Blueprint.model_validate(data)


def _train_stage(bp: Blueprint, out: Path, data: Path, stage: str) -> None:
    factory.train(bp, out=out, data=data, precision="off", seed=0, stage=stage)


def _train_rank(rank: int, world: int, bp: Blueprint, out: Path, data: Path, stage: str) -> None:
    _train_stage(bp, out, data, stage)


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("program-data")
    shards = build_shards(tiny_blueprint(), folder / "shards")
    for name in ("phase1", "phase2"):
        (folder / name).symlink_to(shards)
    return folder


def test_a_stage_on_tensor_parallelism_starts_from_a_one_process_boundary(
    data: Path, tmp_path: Path
) -> None:
    one, two = tmp_path / "one", tmp_path / "two"
    _train_stage(_program({}), one, data, "phase1")
    shutil.copytree(one, two)
    _train_stage(_program({}), one, data, "phase2")
    run_ranks(_train_rank, 2, _program(TP2), two, data, "phase2", timeout=240)

    ours = json.loads((two / "phase2" / "train.json").read_text())["records"]
    theirs = json.loads((one / "phase2" / "train.json").read_text())["records"]
    assert [r["step"] for r in ours] == [r["step"] for r in theirs] == list(range(STEPS))
    for a, b in zip(ours, theirs, strict=True):
        assert a["lm_loss"] == pytest.approx(b["lm_loss"], rel=LOSS_RTOL)
        assert a["lr"] == b["lr"]
    got = load_file(two / "phase2" / "model" / "model.safetensors")
    want = load_file(one / "phase2" / "model" / "model.safetensors")
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        scale = max(tensor.abs().max().item(), 1e-6)
        apart = (got[name] - tensor).abs()
        assert int((apart > WEIGHT_TOL * scale).sum()) == 0, name
        assert apart.max().item() <= STEPS * LR, name
    # The stage started from phase 1's weights, not from a new initialisation.
    first = json.loads((one / "phase1" / "train.json").read_text())["records"][0]["lm_loss"]
    assert ours[0]["lm_loss"] < first
    assert (two / "phase2" / "ranks" / "rank_00001.jsonl").is_file()
