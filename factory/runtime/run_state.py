"""Everything a checkpoint holds, gathered from a running training and put back into it.

Resuming from a checkpoint must continue exactly as the uninterrupted run
would have: the model (expert biases included), the fp32 masters and Adam
state (and ``training.average``'s moving average), the learning-rate schedule's
position and any annealing, the RNG states, the precision runtime
(stochastic-rounding generators, FP8 amax histories, the BF16 switch), the
callbacks' state (the monitors'), and the data position.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from factory.compilation import Compiled
from factory.layers.model_spec import model_spec
from factory.runtime import checkpoint
from factory.runtime.checkpoint_trust import MetadataReader
from factory.runtime.optimizer import MasterOptimizer

__all__ = ["Anneal", "Position", "fingerprint", "restore", "restore_boundary", "snapshot"]


@dataclass
class Anneal:
    """Learning-rate annealing started by a rollback: from ``rate`` at ``start`` down to
    min_lr over ``steps`` steps."""

    start: int
    rate: float
    steps: int


@dataclass
class Position:
    """Where the run is; ``step`` is the next schedule step to run."""

    step: int = 0
    update: int = 0
    tokens_seen: int = 0
    consumed: int = 0
    """Samples of the data stream consumed (its position)."""
    rollbacks: int = 0
    anneal: Anneal | None = None
    schedule_offset: int = 0
    """Steps of the learning-rate schedule that earlier stages of a program took: ``step``
    runs at the schedule's step ``schedule_offset + step``."""


def fingerprint(compiled: Compiled) -> str:
    """A digest of the model's architecture: every tensor's name and shape, and the config."""
    model_config = compiled.blueprint.model
    shapes = sorted(
        (name, list(shape)) for name, shape in model_spec(model_config).shapes().items()
    )
    text = json.dumps([shapes, model_config.model_dump(mode="json")], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


AVERAGE_KEYS = "optimizer.average."
"""The DCP keys of ``training.average``'s moving average in a checkpoint."""


def _holds(path: Path, prefix: str) -> bool:
    """Whether checkpoint ``path`` holds a tensor under ``prefix`` (False when its metadata
    cannot be read: reading the checkpoint then reports the damage)."""
    try:
        keys = MetadataReader(path).read_metadata().state_dict_metadata
    except Exception:  # the read that follows says what is wrong
        return False
    return any(key.startswith(prefix) for key in keys)


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _shared_state(compiled: Compiled, optimizer: MasterOptimizer) -> dict[str, Any]:
    return {"model": compiled.model.state_dict(), "optimizer": optimizer.state_dict()}


def snapshot(
    compiled: Compiled,
    optimizer: MasterOptimizer,
    callback_states: dict[str, Any],
    position: Position,
    data_state: dict[str, Any],
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """(DCP state, process-local state, meta) of the run as it stands; ``callback_states``
    go into the meta under their callbacks' ``state_key``."""
    local = {
        "rng": _rng_state(),
        "precision": compiled.precision.state_dict() if compiled.precision else None,
    }
    meta = {
        "blueprint": compiled.blueprint.meta.name,
        "fingerprint": fingerprint(compiled),
        "position": asdict(position),
        "data": data_state,
        **callback_states,
    }
    return _shared_state(compiled, optimizer), local, meta


def restore(
    path: Path, compiled: Compiled, optimizer: MasterOptimizer, rank: int = 0
) -> tuple[Position, dict[str, Any], dict[str, Any]]:
    """Load checkpoint ``path`` into the model and optimizer (``rank``'s process-local state);
    return its position, data state and meta (which holds the callbacks' states)."""
    state = {"model": compiled.model.state_dict(), "optimizer": optimizer.empty_state_dict()}
    # A checkpoint written before training.average was turned on has no average to read: it
    # starts afresh from the masters it restores.
    fresh_average = "average" in state["optimizer"] and not _holds(path, AVERAGE_KEYS)
    if fresh_average:
        del state["optimizer"]["average"]
    meta, local = checkpoint.read_checkpoint(path, state, fingerprint(compiled), rank)
    # DCP filled the state dict's tensors in place; a model whose state dict presents some
    # tensors in another layout (tensor parallelism's Mamba projections) takes them back here.
    compiled.model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    if fresh_average:
        optimizer.restart_average()
    if compiled.precision is not None:
        compiled.precision.weights_updated()
    _set_rng_state(local["rng"])
    if compiled.precision is not None and local["precision"] is not None:
        compiled.precision.load_state_dict(local["precision"])
    raw = dict(meta["position"])
    anneal = raw.pop("anneal")
    position = Position(**raw, anneal=Anneal(**anneal) if anneal else None)
    return position, meta["data"], meta


def restore_boundary(
    path: Path, compiled: Compiled, optimizer: MasterOptimizer, with_optimizer: bool
) -> dict[str, Any]:
    """Load the weights of checkpoint ``path`` (a program stage's boundary) into ``compiled``
    (the fp32 masters too: the model's own tensors may be of lower precision), and Adam's
    moments and step count when ``with_optimizer``; return its data state. DCP reads every
    tensor by its global name, so the checkpoint lands on whatever layout ``compiled`` has.
    The process-local state (RNG, precision runtime) is not read: a stage starts those
    afresh."""
    empty = optimizer.empty_state_dict()
    # Not training.average's moving average: each stage keeps its own, from its own start.
    wanted = {"state": empty["state"] if with_optimizer else {}, "masters": empty["masters"]}
    state = {"model": compiled.model.state_dict(), "optimizer": wanted}
    meta, _ = checkpoint.read_checkpoint(path, state, fingerprint(compiled))
    compiled.model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    if compiled.precision is not None:
        compiled.precision.weights_updated()
    return meta["data"]
