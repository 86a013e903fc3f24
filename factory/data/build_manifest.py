"""The content of ``manifest.json``: what a build did, per source and category, and its shards.

Assembled from the units' stats (``stages.unit_files``), the dedup counts, the
mixing plans and the write stage's receipts, so both executors write the same
manifest; ``shards.manifest`` writes, reads and verifies the file. Each held-out set's
folder gets a manifest of the same shape (:func:`heldout_manifests`), and the build's
lists them under ``"heldout"`` (``shards.heldout``); the training counts (``after``,
``categories``) never include a held-out document.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from factory.data.loaded_recipe import LoadedRecipe
from factory.data.shards.heldout import HELDOUT_FOLDER
from factory.data.shards.manifest import sha256_file
from factory.data.stages.curate import UnitTask
from factory.data.stages.dedup import DedupCounts
from factory.data.stages.heldout_split import describe
from factory.data.stages.unit_files import read_unit_stats
from factory.data.stages.write_shards import StagesResult
from factory.data.steps.tokenize import DocumentTokenizer
from factory.schemas.data_recipe import SHARE_KEYS, DataRecipe, SourceConfig

__all__ = ["TOKEN_COUNTS", "build_manifest", "heldout_manifests"]

_ROW = ("documents_in", "tokens_in", "documents_out", "tokens_out")
TOKEN_COUNTS = (
    "tokens are counted from the tokenize step on: the filters and decontamination run "
    "before tokenizing, so their rows count documents only (tokens_in and tokens_out null)"
)


def build_manifest(
    loaded: LoadedRecipe,
    digest: str,
    tasks: list[UnitTask],
    stages: StagesResult,
    tokenizer: DocumentTokenizer,
) -> dict[str, Any]:
    """The manifest of a finished build of ``loaded`` (whose hash is ``digest``)."""
    recipe = loaded.recipe
    sources = {}
    for s_index, source in enumerate(recipe.sources):
        own = [task.output_path for task in tasks if task.source_index == s_index]
        sources[source.name] = _source_entry(recipe, source, own, stages)
    return {
        "recipe": {"name": recipe.name, "sha256": digest, "seed": recipe.seed},
        "token_counts": TOKEN_COUNTS,
        "tokenizer": {"sha256": sha256_file(tokenizer.path), "vocab_size": tokenizer.vocab_size},
        "sources": sources,
        "categories": _categories(sources),
        "packing": stages.packing.as_dict(),
        "shards": stages.shards,
        "heldout": {
            category: {
                "folder": f"{HELDOUT_FOLDER}/{category}",
                **_total(written.emitted),
                "sources": written.emitted,
            }
            for category, written in stages.heldout.items()
        },
    }


def heldout_manifests(build: dict[str, Any], stages: StagesResult) -> dict[str, dict[str, Any]]:
    """Each held-out set's own manifest, by category: the build's shape (recipe, tokenizer,
    sources with their ``after`` counts, categories, packing, shards), for its documents;
    ``split`` says whose set it is."""
    manifests = {}
    for category, written in stages.heldout.items():
        sources = {
            name: {
                "category": category,
                "heldout": build["sources"][name]["heldout"]["declared"],
                "after": counts,
            }
            for name, counts in written.emitted.items()
        }
        manifests[category] = {
            "recipe": build["recipe"],
            "token_counts": build["token_counts"],
            "tokenizer": build["tokenizer"],
            "split": {"side": "heldout", "category": category},
            "sources": sources,
            "categories": {category: _total(written.emitted)},
            "packing": written.packing.as_dict(),
            "shards": written.shards,
        }
    return manifests


def _total(emitted: dict[str, dict[str, int]]) -> dict[str, int]:
    return {
        "documents": sum(row["documents"] for row in emitted.values()),
        "tokens": sum(row["tokens"] for row in emitted.values()),
    }


def _step_rows(
    units: list[Path], dedup: DedupCounts
) -> tuple[dict[str, dict[str, Any]], Counter[str], Counter[str]]:
    """A source's rows per step (summed over its units, through dedup), its drops by reason
    and its quarantined lines by reason."""
    steps: dict[str, dict[str, Any]] = {}
    dropped: Counter[str] = Counter()
    quarantined: Counter[str] = Counter()
    for unit in units:
        stats = read_unit_stats(unit)
        for name, row in stats["steps"].items():
            agg = steps.setdefault(name, dict.fromkeys(_ROW, None))
            for k, v in row.items():
                agg[k] = v + (agg[k] or 0)
        dropped.update(stats["dropped"])
        quarantined.update(stats["quarantined"])
        counts = dedup[str(unit)]
        agg = steps.setdefault("dedup", dict.fromkeys(_ROW, 0))
        for k in agg:
            agg[k] += counts[k]
        dropped["dedup:exact"] += counts["exact_duplicates"]
        dropped["dedup:near"] += counts["near_duplicates"]
    return steps, dropped, quarantined


def _source_entry(
    recipe: DataRecipe, source: SourceConfig, units: list[Path], stages: StagesResult
) -> dict[str, Any]:
    steps, dropped, quarantined = _step_rows(units, stages.dedup)
    plan = stages.plans[source.name]
    emitted = stages.emitted.get(source.name, {"documents": 0, "tokens": 0})
    extra: dict[str, Any] = {}
    trained = steps["dedup"]["documents_out"]
    split = recipe.heldout_of(source)
    if split is not None:
        counts = stages.split[source.name]
        trained = counts["train_documents"]
        steps["heldout"] = {
            "documents_in": steps["dedup"]["documents_out"],
            "tokens_in": steps["dedup"]["tokens_out"],
            "documents_out": trained,
            "tokens_out": counts["train_tokens"],
        }
        extra["heldout"] = {
            "declared": describe(split),
            "documents": counts["documents"],
            "tokens": counts["tokens"],
        }
    steps["mix"] = {
        "documents_in": trained,
        "tokens_in": plan.available_tokens,
        "documents_out": emitted["documents"],
        "tokens_out": emitted["tokens"],
    }
    return {
        **extra,
        "category": source.category,
        "path": source.path,
        "files": len(units),
        "steps": steps,
        "dropped": {k: v for k, v in sorted(dropped.items()) if v},
        "quarantined": dict(sorted(quarantined.items())),
        "mix": {
            # The share as the recipe states it: {"weight": w}, {"tokens": n} or {"epochs": e}.
            "declared": {
                key: getattr(source, key) for key in SHARE_KEYS if getattr(source, key) is not None
            },
            "available_tokens": plan.available_tokens,
            "target_tokens": plan.target_tokens,
            "ratio": round(plan.ratio, 6),
            "sampling": "up" if plan.ratio > 1 else ("down" if plan.ratio < 1 else "none"),
        },
        "after": {"documents": emitted["documents"], "tokens": emitted["tokens"]},
    }


def _categories(sources: dict[str, Any]) -> dict[str, dict[str, int]]:
    categories: dict[str, dict[str, int]] = {}
    for entry in sources.values():
        agg = categories.setdefault(entry["category"], {"documents": 0, "tokens": 0})
        agg["documents"] += entry["after"]["documents"]
        agg["tokens"] += entry["after"]["tokens"]
    return categories
