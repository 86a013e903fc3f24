"""The held-out split, after dedup: which of each source's documents are set aside.

A document's *split value* is a 64-bit hash of the recipe's seed and the document's
content hash (the 16 bytes exact dedup keys on, ``steps.dedup_hashing.content_hash``);
a source's split is one number, its *threshold*, and a document whose value is below it
is held out. ``fraction: f`` sets the threshold to ``f * 2**64``, so each document is
decided alone; ``tokens: n`` sorts the source's surviving documents by value and sets
it just past the first value at which their tokens reach ``n``. Either way the decision
depends on the document's content and the seed only, never on the worker count, the
executor or the order units finish in, and equal contents always land on the same side.

Running after dedup means a held-out document has no exact or near duplicate among the
training documents (dedup kept one of them). One call per source (``split_source``,
through the build's runner) writes a held-out mask beside each of its units' keep masks
and returns its counts; ``.work/split.json`` marks the stage done for a resume.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np

from factory.data.stages.dedup import read_keep_mask
from factory.data.stages.runner import Runner
from factory.data.stages.unit_files import read_sidecar, save_npy
from factory.io import atomic_write_text
from factory.progress import Progress
from factory.schemas.data_recipe import DataRecipe, HeldoutSplit

__all__ = [
    "SPLIT_VALUES",
    "Side",
    "SplitCounts",
    "SplitRefused",
    "describe",
    "held_out",
    "split_problems",
    "split_source",
    "split_sources",
    "split_value",
    "unit_mask",
]

SPLIT_VALUES = 2**64
"""Split values lie in [0, 2**64); a threshold of 2**64 holds every document out."""

Side = Literal["train", "heldout"]
"""Which documents of a unit a stream reads: the ones trained on, or the ones set aside."""

SplitCounts = dict[str, dict[str, int]]
"""Per source: ``threshold``, and ``documents`` / ``tokens`` held out and left to train."""


def split_value(seed: int, content: bytes) -> int:
    """The split value of a document whose content hash is ``content`` under ``seed``."""
    digest = hashlib.blake2b(content, digest_size=8, person=b"heldout", salt=_salt(seed))
    return int.from_bytes(digest.digest(), "little")


def _salt(seed: int) -> bytes:
    # blake2b's salt is 16 bytes: the seed (0..2**63-1) fits in its first 8.
    return seed.to_bytes(8, "little") + bytes(8)


def held_out(values: np.ndarray, threshold: int) -> np.ndarray:
    """Which of ``values`` (uint64) a split at ``threshold`` holds out."""
    if threshold >= SPLIT_VALUES:
        return np.ones(len(values), dtype=bool)
    return values < np.uint64(threshold)


def _mask_path(unit: Path) -> Path:
    return unit.with_suffix(".heldout.npy")


def unit_mask(unit: Path, side: Side) -> np.ndarray:
    """Which of ``unit``'s records a stream of ``side`` reads: dedup kept it, and the split
    put it on that side. A unit without a held-out mask (its source has no split) holds
    nothing out."""
    keep = read_keep_mask(unit)
    path = _mask_path(unit)
    held = np.load(path, allow_pickle=False) if path.is_file() else np.zeros_like(keep)
    return keep & held if side == "heldout" else keep & ~held


def _values(seed: int, exact: np.ndarray) -> np.ndarray:
    return np.fromiter(
        (split_value(seed, row.tobytes()) for row in exact), dtype=np.uint64, count=len(exact)
    )


def _threshold(split: HeldoutSplit, values: np.ndarray, lengths: np.ndarray) -> int:
    """The threshold of ``split`` over a source's surviving documents (their split
    ``values`` and token ``lengths``)."""
    if split.fraction is not None:
        return int(split.fraction * SPLIT_VALUES)
    assert split.tokens is not None  # one of the two, by HeldoutSplit's validation
    # Equal values are equal contents: taken together, so none is split across the sides.
    distinct, inverse = np.unique(values, return_inverse=True)
    reached = np.cumsum(np.bincount(inverse, weights=lengths, minlength=len(distinct)))
    enough = np.flatnonzero(reached >= split.tokens)
    return int(distinct[enough[0]]) + 1 if len(enough) else SPLIT_VALUES


def split_source(units: Sequence[Path], split: HeldoutSplit, seed: int) -> dict[str, int]:
    """Write the held-out mask of each of a source's ``units``; return the source's counts."""
    keeps, values, lengths = [], [], []
    for unit in units:
        sidecar = read_sidecar(unit)
        keeps.append(read_keep_mask(unit))
        values.append(_values(seed, sidecar["exact"]))
        lengths.append(sidecar["lengths"])
    kept = np.concatenate(keeps)
    threshold = _threshold(split, np.concatenate(values)[kept], np.concatenate(lengths)[kept])
    counts = dict.fromkeys(("documents", "tokens", "train_documents", "train_tokens"), 0)
    for unit, keep, value, length in zip(units, keeps, values, lengths, strict=True):
        held = keep & held_out(value, threshold)
        save_npy(_mask_path(unit), held)
        counts["documents"] += int(held.sum())
        counts["tokens"] += int(length[held].sum())
        counts["train_documents"] += int((keep & ~held).sum())
        counts["train_tokens"] += int(length[keep & ~held].sum())
    return {"threshold": threshold, **counts}


def split_sources(
    run: Runner, recipe: DataRecipe, units: Mapping[str, list[Path]], work: Path, progress: Progress
) -> SplitCounts:
    """Split every source that has a split (one call each, through ``run``); their counts.

    Resumable: ``work/split.json`` holds the counts of a split that finished.
    """
    marker = work / "split.json"
    if marker.is_file():
        done: SplitCounts = json.loads(marker.read_text(encoding="utf-8"))
        return done
    splits = {s.name: split for s in recipe.sources if (split := recipe.heldout_of(s))}
    calls = [(units[name], split, recipe.seed) for name, split in splits.items()]
    results = run(split_source, calls, "split", progress) if calls else []
    counts = dict(zip(splits, results, strict=True))
    atomic_write_text(marker, json.dumps(counts, sort_keys=True))
    return counts


class SplitRefused(ValueError):
    """Sources whose split leaves them no document to train on: ``problems`` says why, by
    source name (the build names each source's ``heldout`` in the recipe)."""

    def __init__(self, problems: dict[str, str]) -> None:
        self.problems = problems
        super().__init__("; ".join(f"{name}: {why}" for name, why in problems.items()))


def split_problems(counts: SplitCounts) -> dict[str, str]:
    """Sources whose split leaves them no training document, with why, by source name."""
    problems = {}
    for name, row in counts.items():
        if row["documents"] and not row["train_documents"]:
            problems[name] = (
                f"the held-out split takes all {row['documents']:,} documents "
                f"({row['tokens']:,} tokens) left after curation, so none is left to train "
                "on: ask for a smaller fraction or fewer tokens"
            )
    return problems


def describe(split: HeldoutSplit) -> dict[str, Any]:
    """The split as the recipe states it: ``{"fraction": f}`` or ``{"tokens": n}``."""
    return split.model_dump(exclude_none=True)
