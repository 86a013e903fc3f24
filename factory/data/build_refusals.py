"""Why a data build stops before it publishes: the folder is busy, or nothing survived.

Both are the user's to fix (wait for the other build, fix the inputs or ask
for an empty build), so they are ``ValueError``s that name the path they are
about; the CLI prints them as ``factory: <path>: <cause>`` and exits 2.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["BuildRefused", "empty_build", "nothing_survived"]


class BuildRefused(ValueError):
    """A data build that cannot, or must not, run to the end; ``str`` is ``path: cause``."""

    def __init__(self, path: Path, cause: str) -> None:
        self.path = path
        self.cause = cause
        super().__init__(f"{path}: {cause}")


def _counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{reason} {count:,}" for reason, count in sorted(counts.items()))


def nothing_survived(manifest: dict[str, Any]) -> str:
    """Why a build made no shards, from its manifest: documents read, then drops and
    quarantined records by reason, over every source."""
    read = 0
    dropped: dict[str, int] = {}
    quarantined: dict[str, int] = {}
    for source in manifest["sources"].values():
        read += source["steps"].get("read", {}).get("documents_in") or 0
        for reason, count in source["dropped"].items():
            dropped[reason] = dropped.get(reason, 0) + count
        for reason, count in source["quarantined"].items():
            quarantined[reason] = quarantined.get(reason, 0) + count
    parts = [f"{read:,} documents read"]
    if dropped:
        parts.append(f"dropped: {_counts(dropped)}")
    if quarantined:
        parts.append(f"quarantined: {_counts(quarantined)}")
    return f"no documents survived curation ({'; '.join(parts)})"


def empty_build(manifest: dict[str, Any], recipe: Path, quarantine: Path) -> BuildRefused:
    """The refusal of a build of ``recipe`` that made no shards, pointing at ``quarantine``
    when records were quarantined."""
    quarantined = any(source["quarantined"] for source in manifest["sources"].values())
    see = f"; see {quarantine}" if quarantined else ""
    return BuildRefused(
        recipe, f"{nothing_survived(manifest)}{see}; pass --allow-empty to build it anyway"
    )
