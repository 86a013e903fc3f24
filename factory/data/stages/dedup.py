"""Stage 2, global and sequential: exact then MinHash-LSH dedup over all sources.

Units are visited in canonical order (sources as the recipe lists them, files
in sorted order, records in file order), so "first occurrence wins" means the
same document on every run. Only the units' sidecars are read (hashes,
signatures, token counts; ``unit_files.read_sidecar``), never their tokens; the
result is a keep-mask per unit, written atomically, so a killed run resumes here.

The keep masks, the per-unit counts (``dedup.json``: the manifest's ``dedup``
rows and drop reasons) and how both are written are this module's; the
distributed form (``dedup_shuffle``) reaches the same masks and writes them here.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from factory.data.stages.unit_files import read_sidecar, save_npy
from factory.data.steps.dedup_hashing import ExactIndex, LSHIndex
from factory.io import atomic_write_text
from factory.schemas.data_recipe import DedupConfig

__all__ = [
    "DedupCounts",
    "dedup_units",
    "publish_keep_mask",
    "read_dedup_counts",
    "read_keep_mask",
    "write_dedup_counts",
]

DedupCounts = dict[str, dict[str, int]]
"""Per unit (by path): documents and tokens in and out, exact and near duplicates dropped."""


def _mask_path(unit: Path) -> Path:
    return unit.with_suffix(".keep.npy")


def read_keep_mask(unit: Path) -> np.ndarray:
    return np.load(_mask_path(unit))


def publish_keep_mask(
    unit: Path, keep: np.ndarray, lengths: np.ndarray, exact: int, near: int
) -> dict[str, int]:
    """Write ``unit``'s keep mask atomically; return its counts (``exact`` and ``near``
    duplicates dropped, ``lengths`` the tokens of each record)."""
    keep = np.asarray(keep, dtype=bool)
    save_npy(_mask_path(unit), keep)
    return {
        "documents_in": len(keep),
        "documents_out": int(keep.sum()),
        "tokens_in": int(lengths.sum()),
        "tokens_out": int(lengths[keep].sum()),
        "exact_duplicates": exact,
        "near_duplicates": near,
    }


def read_dedup_counts(marker: Path) -> DedupCounts | None:
    """The counts of a dedup that finished (``marker`` is ``.work/dedup.json``), else None."""
    if not marker.is_file():
        return None
    return json.loads(marker.read_text(encoding="utf-8"))


def write_dedup_counts(marker: Path, counts: DedupCounts) -> None:
    """Mark the dedup done, with its counts: written last, so a rerun resumes after it."""
    atomic_write_text(marker, json.dumps(counts, sort_keys=True))


def dedup_units(units: Sequence[Path], config: DedupConfig, done_marker: Path) -> DedupCounts:
    """Write a keep-mask beside every unit; return per-unit counts {unit: {exact, near, kept}}."""
    if (done := read_dedup_counts(done_marker)) is not None:
        return done
    exact = ExactIndex() if config.exact else None
    lsh = LSHIndex(config.bands, config.rows) if config.minhash else None
    results: DedupCounts = {}
    doc_id = 0
    for unit in units:
        sidecar = read_sidecar(unit)
        lengths = sidecar["lengths"]
        signatures = sidecar["signatures"] if lsh is not None else None
        signed = sidecar["signed"]
        keep = np.ones(len(lengths), dtype=bool)
        exact_drops = near_drops = 0
        for i, digest in enumerate(sidecar["exact"]):
            if exact is not None and not exact.add(digest.tobytes()):
                exact_drops += 1
                keep[i] = False
            elif (
                lsh is not None
                and signatures is not None
                and signed[i]
                and lsh.add(doc_id, signatures[i]) is not None  # an earlier id, maybe 0
            ):
                near_drops += 1
                keep[i] = False
            doc_id += 1
        results[str(unit)] = publish_keep_mask(unit, keep, lengths, exact_drops, near_drops)
    write_dedup_counts(done_marker, results)
    return results
