"""Where a build's held-out sets are, and the one reader of their list.

A data build that sets documents aside (``heldout`` of a recipe's sources, or the
recipe's own for every source; ``factory.data.stages.heldout_split``) writes
each category's held-out documents as a folder of its own, ``OUT/heldout/CATEGORY/``: a
built folder like ``OUT`` itself (``manifest.json`` and shards in the same format), so the
trainer's loader, ``factory eval --data`` and ``factory data verify`` read it unchanged.
``OUT/manifest.json`` lists them under ``"heldout"``::

    "heldout": {"code": {"folder": "heldout/code", "documents": 12, "tokens": 3456,
                         "sources": {"code-source": {"documents": 12, "tokens": 3456}}}, ...}

The training shards never hold a held-out document: the split is decided per document by
its hash, before any shard is written.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from factory.data.shards.manifest import ManifestError, read_manifest

__all__ = ["HELDOUT_FOLDER", "HeldoutSet", "empty_splits", "heldout_folder", "heldout_sets"]

HELDOUT_FOLDER = "heldout"
"""The folder of a build's output that holds one built folder per held-out category."""


@dataclass(frozen=True)
class HeldoutSet:
    """One category's held-out documents: a built folder of their own."""

    category: str
    folder: Path
    documents: int
    tokens: int


def heldout_folder(out: Path, category: str) -> Path:
    """The built folder of ``category``'s held-out documents in the build at ``out``."""
    return Path(out) / HELDOUT_FOLDER / category


def heldout_sets(out: Path) -> dict[str, HeldoutSet]:
    """The held-out sets the build at ``out`` lists, by category, in the manifest's order.

    Empty for a build that set nothing aside; :class:`ManifestError` for a folder that is
    no build or whose manifest lists a held-out folder that is not there.
    """
    manifest = read_manifest(out)
    listed: dict[str, Any] = manifest.get("heldout") or {}
    sets = {}
    for category, entry in listed.items():
        folder = Path(out) / entry["folder"]
        if not (folder / "manifest.json").is_file():
            raise ManifestError(folder, f"held-out set {category!r} is listed but not built")
        sets[category] = HeldoutSet(category, folder, int(entry["documents"]), int(entry["tokens"]))
    return sets


def empty_splits(manifest: dict[str, Any]) -> list[str]:
    """The sources of a build's ``manifest`` whose held-out split asked for documents and got
    none (a fraction too small for the source; the build warns, it does not refuse)."""
    return [
        name
        for name, entry in manifest["sources"].items()
        if "heldout" in entry and not entry["heldout"]["documents"]
    ]
