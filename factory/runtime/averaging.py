"""Checkpoint averaging: the fp32 weights of several checkpoints of one run, weighted, streamed.

What is averaged is every floating tensor of a checkpoint's model, each read at fp32: a
parameter whose fp32 master the optimizer keeps (``optimizer.masters.NAME``: a model held in
lower precision) is read from its master, any other tensor from the model itself (fp32
parameters and buffers such as the routers' expert biases). Adam's moments are not averaged:
an average is a set of weights, not a point to resume training from. A tensor that is not
floating is the newest checkpoint's.

Weights (:func:`checkpoint_weights`): checkpoint ``i`` of ``n``, oldest first, weighs ``w_i =
decay ** (n - 1 - i)``: the newest 1, the one before ``decay``, and so on (age counted in
checkpoints, not steps); uniform is ``decay = 1``. The average is ``(sum_i w_i x_i) / (sum_i
w_i)``, summed in fp64 and rounded to fp32 once, at the end. Hence, bit for bit: K equal
checkpoints average to that checkpoint (``K x`` and its quotient by ``K`` are exact in fp64),
and two checkpoints ``a``, ``b`` uniformly to ``(a + b) / 2`` as fp32 computes it (``a + b``
is exact in fp64 and halving commutes with rounding, so rounding once equals fp32's rounding
of the sum, halved).

Memory: the tensors are read a group at a time (at most ``group_bytes`` of them) from each
checkpoint in turn through DCP, which reads only the keys of the state dict it is given; so
beside the averaged model the output keeps, only one group of one checkpoint and that
group's fp64 sum are held, never K models.

The averaged checkpoint (:func:`write_average`) has a training checkpoint's DCP layout under
the same keys (``model.*`` in the model's dtypes, ``optimizer.masters.*`` where the sources
have them) and a ``meta.json`` with the model's fingerprint, so whatever reads a checkpoint's
weights (``read_checkpoint`` with a state of ``model`` and the masters) reads it.

Reading and writing are one process's, without collectives even where a process group is
up (rank 0 writes a training's moving average at its end while the other ranks leave).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from factory.runtime.checkpoint import _local_file, single_process_quiet
from factory.runtime.checkpoint_trust import MetadataReader, TensorsOnlyPlanner

__all__ = [
    "AVERAGE",
    "GROUP_BYTES",
    "MASTERS",
    "MODEL",
    "StoredTensor",
    "average_checkpoints",
    "checkpoint_weights",
    "running_average",
    "stored_tensors",
    "write_average",
]

MODEL = "model."
MASTERS = "optimizer.masters."
AVERAGE = "optimizer.average."
"""Where a training checkpoint keeps ``training.average``'s moving average, by parameter."""
GROUP_BYTES = 256 << 20
"""fp32 bytes of the tensors read from each checkpoint at a time."""


@dataclass(frozen=True)
class StoredTensor:
    """A tensor as a checkpoint's DCP metadata describes it: its global shape and dtype."""

    shape: tuple[int, ...]
    dtype: torch.dtype


def stored_tensors(path: Path, running: bool = True) -> dict[str, StoredTensor]:
    """The model's tensors, fp32 masters and (``running``) moving average checkpoint ``path``
    holds, by DCP key (``model.*``, ``optimizer.masters.*``, ``optimizer.average.*``); read
    from its metadata alone."""
    metadata = MetadataReader(path).read_metadata()
    prefixes = (MODEL, MASTERS, AVERAGE) if running else (MODEL, MASTERS)
    found = {}
    for key, entry in metadata.state_dict_metadata.items():
        if key.startswith(prefixes) and hasattr(entry, "size"):
            found[key] = StoredTensor(tuple(entry.size), entry.properties.dtype)
    return found


def checkpoint_weights(count: int, decay: float = 1.0) -> list[float]:
    """The normalised weight of each of ``count`` checkpoints, oldest first: ``decay ** age``
    (age in checkpoints, the newest 0) over their sum; ``decay = 1`` is uniform."""
    if count < 1 or not 0.0 < decay <= 1.0:
        raise ValueError(f"need count >= 1 and 0 < decay <= 1, got {count} and {decay}")
    raw = _raw_weights(count, decay)
    total = sum(raw)
    return [w / total for w in raw]


def _raw_weights(count: int, decay: float) -> list[float]:
    return [decay ** (count - 1 - i) for i in range(count)]


def _groups(
    keys: Sequence[str], tensors: Mapping[str, StoredTensor], limit: int
) -> Iterator[list[str]]:
    group: list[str] = []
    size = 0
    for key in keys:
        nbytes = 4 * _numel(tensors[key].shape)
        if group and size + nbytes > limit:
            yield group
            group, size = [], 0
        group.append(key)
        size += nbytes
    if group:
        yield group


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _read(
    path: Path, keys: Sequence[str], tensors: Mapping[str, StoredTensor]
) -> dict[str, torch.Tensor]:
    """Tensors ``keys`` of checkpoint ``path``, in their stored dtype (DCP reads these alone)."""
    state = {key: torch.empty(tensors[key].shape, dtype=tensors[key].dtype) for key in keys}
    with single_process_quiet():
        dcp.load(
            state,
            checkpoint_id=str(path),
            storage_reader=MetadataReader(path),
            planner=TensorsOnlyPlanner(),
            no_dist=True,
        )
    return state


def average_checkpoints(
    sources: Sequence[Path], decay: float = 1.0, group_bytes: int = GROUP_BYTES
) -> dict[str, torch.Tensor]:
    """The weighted average of checkpoints ``sources`` (oldest first, one model: the caller
    checks that their :func:`stored_tensors` agree), by DCP key, each tensor in the dtype the
    newest stores it in. Weights and rounding as the module docstring says."""
    return _averaged(sources, MASTERS, decay, group_bytes)


def running_average(path: Path, group_bytes: int = GROUP_BYTES) -> dict[str, torch.Tensor]:
    """The moving average that ``training.average`` keeps in checkpoint ``path``
    (``optimizer.average.*``, fp32, in canonical order whatever the layout that wrote it), as
    :func:`average_checkpoints` returns an average: every model tensor the average covers
    (the trainable ones) is the average's, the others (frozen expert biases) the
    checkpoint's own."""
    return _averaged([path], AVERAGE, 1.0, group_bytes)


def _averaged(
    sources: Sequence[Path], fp32_prefix: str, decay: float, group_bytes: int
) -> dict[str, torch.Tensor]:
    tensors = stored_tensors(sources[-1])
    raw = _raw_weights(len(sources), decay)
    total = sum(raw)
    averaged: dict[str, torch.Tensor] = {}
    # Each model tensor is read at fp32: from ``fp32_prefix`` (its master, or the running
    # average) where the checkpoint holds it there.
    fp32_source = {}
    for key in tensors:
        if key.startswith(MODEL):
            name = key.removeprefix(MODEL)
            fp32_source[key] = fp32_prefix + name if fp32_prefix + name in tensors else key
    floating = [k for k, src in fp32_source.items() if tensors[src].dtype.is_floating_point]
    others = [k for k in fp32_source if k not in floating]
    if others:
        averaged.update(_read(sources[-1], others, tensors))
    model_key = {fp32_source[k]: k for k in floating}
    for group in _groups([fp32_source[k] for k in floating], tensors, group_bytes):
        sums = {src: torch.zeros(tensors[src].shape, dtype=torch.float64) for src in group}
        for path, weight in zip(sources, raw, strict=True):
            for src, value in _read(path, group, tensors).items():
                sums[src].add_(value.to(torch.float64), alpha=weight)
        for src, summed in sums.items():
            mean = (summed / total).to(torch.float32)
            key = model_key[src]
            averaged[key] = mean.to(tensors[key].dtype)
            master = MASTERS + key.removeprefix(MODEL)
            if master in tensors:
                averaged[master] = mean
    return averaged


def write_average(out: Path, averaged: Mapping[str, torch.Tensor], meta: Mapping[str, Any]) -> Path:
    """Write ``averaged`` (from :func:`average_checkpoints`) into the folder ``out`` (new or
    empty) as a checkpoint: DCP files under the training checkpoint's keys, an empty
    ``rank0.pt`` (no RNG nor precision state: nothing resumes from it) and ``meta.json``."""
    out.mkdir(parents=True, exist_ok=True)
    state: dict[str, Any] = {"model": {}, "optimizer": {"masters": {}}}
    for key, value in averaged.items():
        if key.startswith(MASTERS):
            state["optimizer"]["masters"][key.removeprefix(MASTERS)] = value
        else:
            state["model"][key.removeprefix(MODEL)] = value
    with single_process_quiet():
        dcp.save(state, checkpoint_id=str(out), no_dist=True)
    torch.save({}, out / _local_file(0))
    (out / "meta.json").write_text(json.dumps(dict(meta), indent=1) + "\n", encoding="utf-8")
    for path in out.iterdir():
        with open(path, "rb") as handle:
            os.fsync(handle.fileno())
    return out
