"""The ``.nv-meta/`` folder that turns a folder of webdataset shards into an Energon dataset.

Energon (Megatron's data loader) reads a webdataset through three small files
that ``energon prepare`` normally writes interactively. Writing them here makes
the output loadable without that step and keeps them deterministic.

Choice of ``dataset.yaml``: Energon documents two forms, a typed one
(``sample_type: {__module__, __class__}`` plus a ``field_map`` from sample
attributes to file extensions) and a crude one (top-level
``__module__: megatron.energon`` / ``__class__: CrudeWebdataset``, optionally
with ``subflavors``). None of Energon's built-in sample types has fields for
packed token ids, a loss mask and ``cu_seqlens``, so a field map would have
nothing to map onto. We write the crude form: samples reach the training
task encoder as raw dicts (``tokens.npy``, ``loss_mask.npy``,
``cu_seqlens.npy``, ``json``) and its cooker builds the batch. ``subflavors``
are written only when given, so a metadataset blend can tell sources apart.

The random-access index that ``energon prepare`` adds (``shards/*.tar.idx``,
``index.sqlite``, ``index.uuid``) is written by
:mod:`factory.data.shards.energon_index`; :func:`write_energon_dataset` writes both
halves. None of this imports megatron-energon: our writers produce its format
and the tests load the result with the real library. For training,
:func:`factory.data.shards.energon_task_encoder.energon_task_encoder`
(megatron-energon installed) cooks the crude samples into tokens, loss mask and
``cu_seqlens``.
"""

from __future__ import annotations

import json
from pathlib import Path, PurePosixPath
from typing import Any

import yaml

from factory.data.shards.energon_index import META_DIR, write_energon_index
from factory.io import atomic_write_text

__all__ = [
    "ENERGON_FORMAT_VERSION",
    "META_DIR",
    "write_energon_dataset",
    "write_energon_metadata",
]


ENERGON_FORMAT_VERSION = "7.4.1"
"""The megatron-energon release whose ``energon prepare`` output these files reproduce."""


def _check_names(shard_names: list[str], sample_counts: list[int]) -> None:
    """Shard names are paths relative to the dataset root, as Energon resolves them."""
    if len(shard_names) != len(sample_counts):
        raise ValueError(f"{len(shard_names)} shard names but {len(sample_counts)} sample counts")
    if len(set(shard_names)) != len(shard_names):
        raise ValueError("shard names must be unique")
    for name in shard_names:
        pure = PurePosixPath(name)
        if not name or pure.is_absolute() or ".." in pure.parts or "\\" in name:
            raise ValueError(
                f"shard name {name!r} must be a relative POSIX path inside the dataset"
            )
    for count in sample_counts:
        if int(count) < 0:
            raise ValueError(f"sample counts must be non-negative, got {count}")


def _dump_yaml(data: dict[str, Any]) -> str:
    return yaml.safe_dump(data, sort_keys=False, default_flow_style=False, allow_unicode=True)


def write_energon_metadata(
    out: Path,
    shard_names: list[str],
    sample_counts: list[int],
    subflavors: dict[str, Any] | None = None,
) -> None:
    """Write ``out/.nv-meta/{dataset.yaml, split.yaml, .info.json}``, each atomically.

    All shards go to the ``train`` split part (the recipe decides held-out data
    upstream, so ``val`` and ``test`` are empty and nothing is excluded).
    ``.info.json`` keeps the shards in the given order: Energon indexes
    samples by shard position, so the order is part of the dataset.
    """
    _check_names(shard_names, sample_counts)
    meta = Path(out) / META_DIR

    dataset: dict[str, Any] = {"__module__": "megatron.energon", "__class__": "CrudeWebdataset"}
    if subflavors:
        dataset["subflavors"] = dict(sorted(subflavors.items()))
    split = {
        "exclude": [],
        "split_parts": {"train": list(shard_names), "val": [], "test": []},
    }
    info = {
        "energon_version": ENERGON_FORMAT_VERSION,
        "shard_counts": {
            name: int(count) for name, count in zip(shard_names, sample_counts, strict=True)
        },
    }

    atomic_write_text(meta / "dataset.yaml", _dump_yaml(dataset))
    atomic_write_text(meta / "split.yaml", _dump_yaml(split))
    atomic_write_text(meta / ".info.json", json.dumps(info, indent=2) + "\n")


def write_energon_dataset(out: Path, shard_names: list[str], sample_counts: list[int]) -> None:
    """Everything ``energon prepare`` writes: the index over the tars, then the yaml/json.

    The index is written first and checked against ``sample_counts``, so the
    metadata never describes shards the index disagrees with.
    """
    _check_names(shard_names, sample_counts)
    write_energon_index(Path(out), shard_names, sample_counts)
    write_energon_metadata(out, shard_names, sample_counts)
