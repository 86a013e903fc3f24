"""Stage 2, global and sequential: exact then MinHash-LSH dedup over all sources.

Units are visited in canonical order (sources as the recipe lists them, files
in sorted order, records in file order), so "first occurrence wins" means the
same document on every run. Only the units' sidecars are read (hashes,
signatures, token counts; ``unit_files.read_sidecar``), never their tokens; the
result is a keep-mask per unit, written atomically, so a killed run resumes here.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from factory.data.stages.unit_files import read_sidecar
from factory.schemas.data_recipe import DedupConfig

__all__ = ["dedup_units", "read_keep_mask", "write_keep_mask"]


def _mask_path(unit: Path) -> Path:
    return unit.with_suffix(".keep.npy")


def read_keep_mask(unit: Path) -> np.ndarray:
    return np.load(_mask_path(unit))


def write_keep_mask(unit: Path, keep: np.ndarray) -> None:
    """Publish ``unit``'s keep mask atomically (the distributed dedup writes the same file)."""
    tmp = _mask_path(unit).with_name(_mask_path(unit).name + f".tmp{os.getpid()}.npy")
    np.save(tmp, np.asarray(keep, dtype=bool))
    os.replace(tmp, _mask_path(unit))


def dedup_units(units: Sequence[Path], config: DedupConfig, done_marker: Path) -> dict[str, dict]:
    """Write a keep-mask beside every unit; return per-unit counts {unit: {exact, near, kept}}."""
    if done_marker.is_file():
        return json.loads(done_marker.read_text(encoding="utf-8"))
    from factory.data.steps.dedup_hashing import ExactIndex, LSHIndex

    exact = ExactIndex() if config.exact else None
    lsh = LSHIndex(config.bands, config.rows) if config.minhash else None
    results: dict[str, dict] = {}
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
        write_keep_mask(unit, keep)
        results[str(unit)] = {
            "documents_in": len(keep),
            "documents_out": int(keep.sum()),
            "tokens_in": int(lengths.sum()),
            "tokens_out": int(lengths[keep].sum()),
            "exact_duplicates": exact_drops,
            "near_duplicates": near_drops,
        }
    tmp = done_marker.with_name(done_marker.name + ".tmp")
    tmp.write_text(json.dumps(results, sort_keys=True), encoding="utf-8")
    os.replace(tmp, done_marker)
    return results
