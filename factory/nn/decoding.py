"""Incremental decoding: the state a mixer keeps between steps, and how a step is undone.

A mixer that can decode one position (or a few) at a time defines
``init_cache(batch, capacity, device, dtype) -> DecodingCache`` and
``decode(x, cache)``: ``x`` [B, T, d] are the next T positions, the cache holds
everything the positions before them contribute, and ``decode`` returns what
``forward`` would return for those positions over the whole sequence, appending
them to the cache. A self-speculative verification appends several positions and
then keeps only the ones the model accepted: :meth:`DecodingCache.keep`. A mixer
that cannot decode leaves ``init_cache`` out, or names why in
``decoding_problem()``; :func:`decoding_problem` is what the generator asks.
"""

from __future__ import annotations

from typing import Protocol

from torch import nn

__all__ = ["DecodingCache", "StatelessCache", "decoding_problem"]


class DecodingCache(Protocol):
    """What one layer keeps between decoding steps."""

    def keep(self, count: int) -> None:
        """Of the positions the last ``decode`` appended, keep the first ``count`` and forget
        the rest, as if only they had been decoded."""
        ...


class StatelessCache:
    """The cache of a token-wise mixer (MLP, MoE): nothing to keep."""

    def keep(self, count: int) -> None:
        """Nothing to forget: a token-wise mixer's output depends on its own position only."""


def decoding_problem(mixer: nn.Module) -> str | None:
    """Why ``mixer`` cannot decode incrementally, or None where it can."""
    if not callable(getattr(mixer, "init_cache", None)) or not callable(
        getattr(mixer, "decode", None)
    ):
        return f"its mixer ({type(mixer).__name__}) has no incremental decoding step"
    ask = getattr(mixer, "decoding_problem", None)
    return ask() if callable(ask) else None
