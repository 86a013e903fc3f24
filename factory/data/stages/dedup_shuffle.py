"""Stage 2 across machines: exact and MinHash-LSH dedup as a shuffle of keys.

The local stage (``stages.dedup``) walks every document in canonical order
through two in-memory indexes. Here the same decisions come from four kinds
of task, none of which holds the corpus, and the driver holds only task
handles:

1. **map**, one per unit: read the unit's sidecar (written by curate,
   ``unit_files.read_sidecar``: keys, lengths, offsets, exact hashes and
   signatures, no tokens) and send its exact keys and LSH band keys, each to
   partition ``key % P``.
2. **reduce**, one per partition: sort the partition's keys; an exact key
   seen before (by document id) marks an exact duplicate; each (band, key)
   shared by two or more documents becomes a *group*, written as
   (document id, group) pairs.
3. **resolve**, one task: walk the documents of the groups in id order. A
   document is a near duplicate when one of its groups already holds a kept
   document; otherwise it is kept and marks its groups. Exact duplicates take
   no part (the local index neither checks nor adds them). This is the local
   greedy keep-first rule exactly, so the masks are identical; its memory is
   one bit per group plus the pairs, i.e. it grows with the near-duplicate
   candidates, not with the corpus.
4. **mask**, one per unit: the unit's keep mask and counts, from the sorted
   duplicate ids (binary search, memory-mapped).

A document's id is ``unit_index << 32 | record``: canonical order without
knowing any unit's length in advance. :func:`shuffle_dedup` runs the four
through a runner (the Ray executor's), each task writing its output atomically
and skipping work already on disk.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from factory.data.stages.dedup import (
    DedupCounts,
    publish_keep_mask,
    read_dedup_counts,
    write_dedup_counts,
)
from factory.data.stages.runner import Runner
from factory.data.stages.unit_files import read_sidecar, save_npy, save_npz
from factory.data.steps.dedup_hashing import LSHIndex
from factory.progress import Progress, silent
from factory.schemas.data_recipe import DedupConfig

__all__ = [
    "DEFAULT_PARTITIONS",
    "doc_id",
    "map_unit",
    "mask_unit",
    "reduce_partition",
    "resolve_groups",
    "shuffle_dedup",
]

DEFAULT_PARTITIONS = 16
"""Dedup shuffle partitions: reduce tasks that run side by side (any count gives the same
result; more spreads the reduce over more nodes)."""

_RECORD_BITS = 32


def doc_id(unit_index: int, record: int) -> int:
    """The global, order-preserving id of record ``record`` of unit ``unit_index``."""
    return (unit_index << _RECORD_BITS) | record


def _partition_file(work: Path, partition: int, unit_index: int) -> Path:
    return work / "map" / f"p{partition:05d}" / f"u{unit_index:07d}.npz"


def map_unit(unit: Path, unit_index: int, config: DedupConfig, work: Path, partitions: int) -> None:
    """Send ``unit``'s keys to their partitions; a no-op when already done."""
    done = work / "map" / "done" / f"u{unit_index:07d}"
    if done.is_file():
        return
    sidecar = read_sidecar(unit)
    n = len(sidecar["keys"])
    ids = doc_id(unit_index, 0) + np.arange(n, dtype=np.int64)
    if config.exact:
        exact = np.ascontiguousarray(sidecar["exact"]).view(np.uint64).reshape(-1, 2)
        exact_doc = ids
    else:
        exact, exact_doc = np.zeros((0, 2), np.uint64), np.zeros(0, np.int64)
    signatures, signed = sidecar["signatures"], sidecar["signed"]
    if config.minhash and signatures is not None:
        lsh = LSHIndex(config.bands, config.rows)
        rows = np.flatnonzero(signed)
        keys = [lsh.band_keys(signatures[i]) for i in rows.tolist()]
        band_key = np.asarray(keys, dtype=np.uint64).reshape(-1)
        band = np.tile(np.arange(config.bands, dtype=np.uint16), len(rows))
        band_doc = np.repeat(ids[rows], config.bands)
    else:
        band = np.zeros(0, np.uint16)
        band_key = np.zeros(0, np.uint64)
        band_doc = np.zeros(0, np.int64)
    exact_part = exact[:, 0] % np.uint64(partitions)
    band_part = band_key % np.uint64(partitions)
    for p in range(partitions):
        e, b = exact_part == p, band_part == p
        save_npz(
            _partition_file(work, p, unit_index),
            exact=exact[e],
            exact_doc=exact_doc[e],
            band=band[b],
            band_key=band_key[b],
            band_doc=band_doc[b],
        )
    done.parent.mkdir(parents=True, exist_ok=True)
    done.touch()


def _runs(*columns: np.ndarray) -> np.ndarray:
    """Boolean per sorted row: True where the row starts a new run of equal ``columns``."""
    n = len(columns[0])
    start = np.zeros(n, dtype=bool)
    if n:
        start[0] = True
        for column in columns:
            start[1:] |= column[1:] != column[:-1]
    return start


def reduce_partition(work: Path, partition: int) -> None:
    """Exact duplicates and LSH groups of one partition; a no-op when already done."""
    out = work / "reduce" / f"p{partition:05d}.npz"
    if out.is_file():
        return
    parts = sorted((work / "map" / f"p{partition:05d}").glob("u*.npz"))
    loaded = [np.load(path) for path in parts]

    def cat(name: str, dtype: np.dtype, shape: tuple[int, ...] = (0,)) -> np.ndarray:
        arrays = [data[name] for data in loaded]
        return np.concatenate(arrays) if arrays else np.zeros(shape, dtype=dtype)

    exact, exact_doc = (
        cat("exact", np.dtype(np.uint64), (0, 2)),
        cat("exact_doc", np.dtype(np.int64)),
    )
    order = np.lexsort((exact_doc, exact[:, 1], exact[:, 0]))
    first = _runs(exact[order, 0], exact[order, 1])
    duplicates = np.sort(exact_doc[order][~first])

    band, key, doc = (
        cat("band", np.dtype(np.uint16)),
        cat("band_key", np.dtype(np.uint64)),
        cat("band_doc", np.dtype(np.int64)),
    )
    order = np.lexsort((doc, key, band))
    band, key, doc = band[order], key[order], doc[order]
    start = _runs(band, key)
    group = np.cumsum(start) - 1  # group number of every row
    sizes = np.bincount(group) if len(group) else np.zeros(0, dtype=np.int64)
    shared = sizes[group] >= 2 if len(group) else np.zeros(0, dtype=bool)
    # Renumber the groups that have two or more members 0..G-1.
    kept_groups = np.flatnonzero(sizes >= 2)
    renumber = np.full(len(sizes), -1, dtype=np.int64)
    renumber[kept_groups] = np.arange(len(kept_groups))
    pair_doc, pair_group = doc[shared], renumber[group[shared]]
    order = np.lexsort((pair_group, pair_doc))
    save_npz(
        out,
        exact_duplicates=duplicates,
        pair_doc=pair_doc[order],
        pair_group=pair_group[order],
        groups=np.asarray([len(kept_groups)], dtype=np.int64),
    )


def resolve_groups(work: Path, partitions: int) -> None:
    """The near duplicates: the keep-first rule over every partition's groups, in id order."""
    out = work / "reduce" / "near.npy"
    if out.is_file():
        return
    exact, docs, groups, offset = [], [], [], 0
    for p in range(partitions):
        data = np.load(work / "reduce" / f"p{p:05d}.npz")
        exact.append(data["exact_duplicates"])
        docs.append(data["pair_doc"])
        groups.append(data["pair_group"] + offset)  # partitions number groups from 0
        offset += int(data["groups"][0])
    exact_all = np.concatenate(exact)
    save_npy(work / "reduce" / "exact.npy", np.sort(exact_all))
    doc, group = np.concatenate(docs), np.concatenate(groups)
    order = np.lexsort((group, doc))
    doc, group = doc[order], group[order]
    excluded = np.isin(doc, exact_all)
    starts = np.flatnonzero(_runs(doc))
    ends = np.append(starts[1:], len(doc))[: len(starts)]
    has_kept = np.zeros(offset, dtype=bool)
    near = []
    for lo, hi in zip(starts.tolist(), ends.tolist(), strict=True):
        if excluded[lo]:
            continue
        members = group[lo:hi]
        if has_kept[members].any():
            near.append(doc[lo])
        else:
            has_kept[members] = True
    save_npy(out, np.asarray(near, dtype=np.int64))


def _in_unit(sorted_ids: np.ndarray, unit_index: int) -> np.ndarray:
    lo, hi = doc_id(unit_index, 0), doc_id(unit_index + 1, 0)
    a, b = np.searchsorted(sorted_ids, [lo, hi])
    return (sorted_ids[a:b] - lo).astype(np.int64)


def mask_unit(unit: Path, unit_index: int, work: Path) -> dict[str, int]:
    """Write ``unit``'s keep mask; return its counts, as ``stages.dedup.dedup_units`` does."""
    lengths = read_sidecar(unit)["lengths"]
    exact = _in_unit(np.load(work / "reduce" / "exact.npy", mmap_mode="r"), unit_index)
    near = _in_unit(np.load(work / "reduce" / "near.npy", mmap_mode="r"), unit_index)
    keep = np.ones(len(lengths), dtype=bool)
    keep[exact] = False
    keep[near] = False
    return publish_keep_mask(unit, keep, lengths, len(exact), len(near))


def shuffle_dedup(
    run: Runner,
    units: list[Path],
    config: DedupConfig,
    work: Path,
    progress: Progress,
    partitions: int = DEFAULT_PARTITIONS,
) -> DedupCounts:
    """The dedup of ``units`` (canonical order) as map, reduce, resolve and mask calls through
    ``run``; per-unit counts, as ``stages.dedup.dedup_units`` returns them."""
    marker = work / "dedup.json"
    if (done := read_dedup_counts(marker)) is not None:
        progress("dedup", 1, 1)
        return done
    shuffle = work / "shuffle"
    maps = [(unit, i, config, shuffle, partitions) for i, unit in enumerate(units)]
    run(map_unit, maps, "dedup map", progress)
    run(reduce_partition, [(shuffle, p) for p in range(partitions)], "dedup reduce", progress)
    run(resolve_groups, [(shuffle, partitions)], "resolve_groups", silent)
    masks = [(unit, i, shuffle) for i, unit in enumerate(units)]
    counts = run(mask_unit, masks, "dedup mask", progress)
    results = {str(unit): row for unit, row in zip(units, counts, strict=True)}
    write_dedup_counts(marker, results)
    return results
