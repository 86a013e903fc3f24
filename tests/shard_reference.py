"""A shard reader built on ``tarfile`` and ``np.load``: the tests' independent check of the
data package's own reader (``factory.data.shards.shard_reader``, a USTAR header walk) and
of the writer's format as docs/data.md states it."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import numpy as np

from factory.data.shards.sample_format import PackedSample

MEMBERS = {"tokens.npy": "tokens", "loss_mask.npy": "loss_mask", "cu_seqlens.npy": "cu_seqlens"}


def read_shard(path: Path) -> list[PackedSample]:
    """Every sample of the webdataset tar at ``path``, doc keys included, in stored order."""
    grouped: dict[str, dict[str, bytes]] = {}
    with tarfile.open(path, mode="r:") as tar:
        for member in tar:
            if not member.isfile():
                continue
            key, _, ext = member.name.partition(".")
            handle = tar.extractfile(member)
            assert handle is not None
            grouped.setdefault(key, {})[ext] = handle.read()
    samples = []
    for parts in grouped.values():
        arrays = {
            attr: np.load(io.BytesIO(parts[ext]), allow_pickle=False)
            for ext, attr in MEMBERS.items()
        }
        doc_keys = list(json.loads(parts["json"].decode("utf-8"))["doc_keys"])
        samples.append(PackedSample(doc_keys=doc_keys, **arrays))
    return samples
