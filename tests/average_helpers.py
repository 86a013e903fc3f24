"""A tiny fp32 run with ``training.average``, and the average its formula gives, read back from
its checkpoints (shared by test_average_training.py and test_average_distributed.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from runtime_helpers import GLOBAL, tiny_blueprint

import factory
from factory.jobs.train_request import CheckpointPolicy
from factory.runtime.averaging import AVERAGE, MODEL, stored_tensors
from factory.runtime.checkpoint import single_process_quiet
from factory.schemas.blueprint import Blueprint

STEPS, DECAY, START = 6, 0.75, 2
AVERAGE_SECTION = {"decay": DECAY, "start": START}


def blueprint(world: int = 1, average: bool = True, **parallelism: Any) -> Blueprint:
    """The tiny blueprint, fp32 (precision off in the runs), lr 1e-3 as the distributed
    comparisons use, no aux loss (test_distributed_train says why)."""
    training: dict[str, Any] = {"steps": STEPS, "optimizer": {"lr": 1e-3, "min_lr": 1e-4}}
    if average:
        training["average"] = AVERAGE_SECTION
    bp = tiny_blueprint(
        parallelism={"world_size": world, "global_batch_size": 2 * GLOBAL, **parallelism},
        training=training,
    )
    data = bp.model_dump(exclude_unset=True)
    data["model"]["moe"].setdefault("router", {})["aux_loss"] = "none"
    return Blueprint.model_validate(data)


def train(bp: Blueprint, out: Path, data: Path) -> Path:
    factory.train(bp, out=out, data=data, precision="off", seed=0,
                  checkpoints=CheckpointPolicy(every=1, keep=STEPS))  # fmt: skip
    return out


def _train_rank(rank: int, world: int, bp: Blueprint, out: Path, data: Path) -> None:
    train(bp, out, data)


def read(checkpoint: Path, prefix: str) -> dict[str, torch.Tensor]:
    """The tensors under ``prefix`` of a checkpoint, whole, by parameter name."""
    tensors = {k: v for k, v in stored_tensors(checkpoint).items() if k.startswith(prefix)}
    state = {k: torch.empty(v.shape, dtype=v.dtype) for k, v in tensors.items()}
    with single_process_quiet():
        dcp.load(state, checkpoint_id=str(checkpoint), no_dist=True)
    return {k.removeprefix(prefix): v for k, v in state.items()}


def expected_average(run: Path) -> dict[str, torch.Tensor]:
    """The EMA as documented, from the masters after each step (checkpoint step_{s+1} holds
    them after step s): the masters at START, then avg * DECAY + master * (1 - DECAY)."""
    trainable = read(run / "checkpoints" / f"step_{STEPS:08d}", AVERAGE).keys()
    average: dict[str, torch.Tensor] = {}
    for step in range(START, STEPS):
        masters = read(run / "checkpoints" / f"step_{step + 1:08d}", MODEL)
        for name in trainable:
            if step == START:
                average[name] = masters[name].clone()
            else:
                average[name].mul_(DECAY).add_(masters[name], alpha=1 - DECAY)
    return average


def same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
