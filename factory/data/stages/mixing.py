"""Mixing: turn weights and token budgets into a repeat count for every document.

After curation each source holds A_s tokens. A source with a token budget gets
T_s = its budget; a source with ``epochs`` E gets T_s = E x A_s (SFT's dynamic
sampling: a small set runs many epochs, a large one a few); weighted sources
share ``total_tokens`` (or, when unset, their combined A) in proportion to
their weights. Each document is then kept
floor(r) or floor(r)+1 times, r = T_s / A_s, the extra copy decided by a hash
of (seed, document key): deterministic, independent of order and workers, and
close to T_s in expectation. r < 1 downsamples, r > 1 upsamples (recorded in
the manifest).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass

from factory.schemas.data_recipe import DataRecipe

__all__ = ["SourcePlan", "plan_mixture", "repeats"]


@dataclass(frozen=True)
class SourcePlan:
    available_tokens: int
    target_tokens: int

    @property
    def ratio(self) -> float:
        return self.target_tokens / self.available_tokens if self.available_tokens else 0.0


def plan_mixture(recipe: DataRecipe, available: Mapping[str, int]) -> dict[str, SourcePlan]:
    weighted = [s for s in recipe.sources if s.weight is not None]
    pool = recipe.total_tokens or sum(available[s.name] for s in weighted)
    weight_sum = sum(s.weight or 0.0 for s in weighted) or 1.0
    plans = {}
    for source in recipe.sources:
        if source.tokens is not None:
            target = source.tokens
        elif source.epochs is not None:
            target = round(source.epochs * available[source.name])
        else:
            target = round(pool * (source.weight or 0.0) / weight_sum)
        plans[source.name] = SourcePlan(available[source.name], target)
    return plans


def _unit(seed: int, key: str) -> float:
    digest = hashlib.blake2b(f"{seed}:{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64


def repeats(ratio: float, seed: int, key: str) -> int:
    """How many copies of document ``key`` the mixture takes."""
    whole = math.floor(ratio)
    return whole + (1 if _unit(seed, key) < ratio - whole else 0)
