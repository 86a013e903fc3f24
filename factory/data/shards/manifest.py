"""``manifest.json``: what a build produced, with a sha256 per shard so it can be verified.

Why hashes: shards are byte-deterministic (see ``tar_writer``), so a hash both
proves a rebuild reproduced a shard and catches any later corruption, down to
one flipped byte. A resumed build trusts a shard only if its hash matches.

Shards are listed as ``manifest["shards"] = [{"name", "sha256", "samples"}, ...]``
with ``name`` relative to the output folder.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path, PurePosixPath
from typing import Any

from factory.io import atomic_write_text

__all__ = [
    "MANIFEST_NAME",
    "ManifestError",
    "read_manifest",
    "sha256_file",
    "shard_entry",
    "verify",
    "write_manifest",
]

MANIFEST_NAME = "manifest.json"
_CHUNK = 1 << 20


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in 1 MiB chunks (shards can be gigabytes)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def shard_entry(name: str, sha256: str, samples: int) -> dict[str, Any]:
    """One ``manifest["shards"]`` entry."""
    return {"name": name, "sha256": sha256, "samples": int(samples)}


def write_manifest(out: Path, manifest: dict[str, Any]) -> Path:
    """Write ``out/manifest.json`` atomically; sorted keys and indent 2 keep it diffable."""
    path = Path(out) / MANIFEST_NAME
    atomic_write_text(path, json.dumps(manifest, sort_keys=True, indent=2) + "\n")
    return path


class ManifestError(ValueError):
    """A folder without a readable manifest (the user named the wrong folder, or the build
    never finished, or the file was damaged); ``str`` is ``path: cause``."""

    def __init__(self, path: Path, cause: str) -> None:
        self.path = path
        self.cause = cause
        super().__init__(f"{path}: {cause}")


def read_manifest(out: Path) -> dict[str, Any]:
    """Load ``out/manifest.json``; ``ManifestError`` names the folder or file and what is wrong."""
    out = Path(out)
    if not out.is_dir():
        raise ManifestError(out, "not a folder" if out.exists() else "no such folder")
    path = out / MANIFEST_NAME
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        cause = "no manifest: not a data build folder, or its build never finished"
        raise ManifestError(path, cause) from None
    except UnicodeDecodeError as exc:
        raise ManifestError(path, f"not UTF-8 text (byte {exc.start})") from None
    except json.JSONDecodeError as exc:
        cause = f"not valid JSON (line {exc.lineno}, column {exc.colno})"
        raise ManifestError(path, cause) from None
    if not isinstance(manifest, dict):
        raise ManifestError(path, "not a JSON object")
    return manifest


def _inside(out: Path, name: str) -> Path | None:
    """The shard's path, or None for a name that would escape the output folder."""
    pure = PurePosixPath(name)
    if not name or pure.is_absolute() or ".." in pure.parts:
        return None
    return Path(out).joinpath(*pure.parts)


def verify(out: Path) -> list[str]:
    """Re-hash every shard listed in the manifest; return the names that are missing or differ.

    An empty list means every listed shard is present and byte-identical to
    what was recorded; a folder without a readable manifest raises ``ManifestError``. Malformed entries are reported by whatever name they
    carry (or their position) rather than skipped, so nothing passes silently.
    """
    shards = read_manifest(out).get("shards", [])
    if not isinstance(shards, list):
        raise ManifestError(Path(out) / MANIFEST_NAME, "'shards' must be a list")
    bad: list[str] = []
    for position, entry in enumerate(shards):
        name = entry.get("name") if isinstance(entry, dict) else None
        expected = entry.get("sha256") if isinstance(entry, dict) else None
        label = name if isinstance(name, str) and name else f"<shards[{position}]>"
        path = _inside(out, name) if isinstance(name, str) else None
        intact = (
            path is not None
            and isinstance(expected, str)
            and path.is_file()
            and sha256_file(path) == expected.lower()
        )
        if not intact:
            bad.append(label)
    return bad
