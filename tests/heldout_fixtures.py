"""Held-out sets for the evaluation tests: a built folder with ``heldout/CATEGORY/`` folders
and the manifest's ``heldout`` section, as ``factory.data.shards.heldout`` reads them.

Each category's folder takes a few of the build's shards (its own manifest lists them), so
the sets hold different documents without building a recipe twice. At 64 tokens the sample
corpus packs about one document per sequence, so every held-out sample is also cut at
DOCUMENT_CUTS into several documents: an evaluation must keep packed documents apart.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from factory.data.shards.heldout import HELDOUT_FOLDER
from factory.data.shards.sample_format import PackedSample
from factory.data.shards.shard_reader import ShardInfo, read_shard_samples
from factory.data.shards.tar_writer import write_shard

CATEGORIES = {"web": (3, 5), "code": (10, 11)}
"""Category: the range of the build's shards its held-out folder holds."""
DOCUMENT_CUTS = (13, 40)
"""Extra document boundaries in every held-out sample."""


def _cut(sample: PackedSample) -> PackedSample:
    ends = sorted({*sample.cu_seqlens.tolist(), *DOCUMENT_CUTS} - {0})
    ends = [end for end in ends if end <= sample.cu_seqlens[-1]]
    return PackedSample(
        tokens=sample.tokens.copy(),
        loss_mask=sample.loss_mask.copy(),
        cu_seqlens=np.array([0, *ends], dtype=np.int32),
        doc_keys=[f"piece-{i}" for i in range(len(ends))],
    )


def add_heldout_sets(out: Path, categories: dict[str, tuple[int, int]] = CATEGORIES) -> Path:
    """Give the built folder ``out`` held-out sets of its own shards; returns ``out``."""
    manifest = json.loads((out / "manifest.json").read_text())
    listed = {}
    for category, (first, last) in categories.items():
        folder = out / HELDOUT_FOLDER / category
        (folder / "shards").mkdir(parents=True, exist_ok=True)
        shards = []
        for index, entry in enumerate(manifest["shards"][first:last]):
            source = ShardInfo(
                entry["name"], out / entry["name"], entry["samples"], entry["sha256"]
            )
            samples = [_cut(s) for s in read_shard_samples(source)]
            sha = write_shard(folder / entry["name"], samples, index)
            shards.append({**entry, "sha256": sha})
        own = {key: value for key, value in manifest.items() if key != "heldout"}
        (folder / "manifest.json").write_text(json.dumps({**own, "shards": shards}))
        samples = sum(entry["samples"] for entry in shards)
        listed[category] = {
            "folder": f"{HELDOUT_FOLDER}/{category}",
            "documents": samples,
            "tokens": samples * int(manifest["packing"]["seq_len"]),
            "sources": {},
        }
    manifest["heldout"] = listed
    (out / "manifest.json").write_text(json.dumps(manifest))
    return out
