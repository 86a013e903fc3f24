"""Held-out sets for the evaluation tests: a built folder with ``heldout/CATEGORY/`` folders
and the manifest's ``heldout`` section, as ``factory.data.shards.heldout`` reads them.

Each category's folder takes a few of the build's shards (its own manifest lists them), so
the sets hold different documents without building a recipe twice.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from factory.data.shards.heldout import HELDOUT_FOLDER

CATEGORIES = {"web": (3, 5), "code": (10, 11)}
"""Category: the range of the build's shards its held-out folder holds."""


def add_heldout_sets(out: Path, categories: dict[str, tuple[int, int]] = CATEGORIES) -> Path:
    """Give the built folder ``out`` held-out sets of its own shards; returns ``out``."""
    manifest = json.loads((out / "manifest.json").read_text())
    listed = {}
    for category, (first, last) in categories.items():
        folder = out / HELDOUT_FOLDER / category
        (folder / "shards").mkdir(parents=True, exist_ok=True)
        shards = manifest["shards"][first:last]
        for entry in shards:
            shutil.copyfile(out / entry["name"], folder / entry["name"])
        own = {key: value for key, value in manifest.items() if key != "heldout"}
        (folder / "manifest.json").write_text(json.dumps({**own, "shards": shards}))
        samples = sum(entry["samples"] for entry in shards)
        tokens = samples * int(manifest["packing"]["seq_len"])
        listed[category] = {
            "folder": f"{HELDOUT_FOLDER}/{category}",
            "documents": samples,
            "tokens": tokens,
            "sources": {},
        }
    manifest["heldout"] = listed
    (out / "manifest.json").write_text(json.dumps(manifest))
    return out
