"""The ``data`` section: which data recipe feeds the model, and how much of it."""

from __future__ import annotations

from factory.schemas.base import Section, SeqLen, TokenCount

__all__ = ["DataConfig"]


class DataConfig(Section):
    """Data for pretraining."""

    recipe: str
    """A data recipe: a preset name (e.g. 'nano') or a path to a recipe YAML."""
    seq_len: SeqLen
    """Training sequence length; packed samples are exactly this long (at most 2**24)."""
    tokens: TokenCount
    """Token budget of the curated mixture (accepts suffixes: '25T'; at most 10**16)."""
