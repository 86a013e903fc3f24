"""The ``data`` section: which data recipe feeds the model, and how much of it."""

from __future__ import annotations

from factory.schemas.base import Count, PositiveInt, Section

__all__ = ["DataConfig"]


class DataConfig(Section):
    """Data for pretraining."""

    recipe: str
    """A data recipe: a preset name (e.g. 'nano') or a path to a recipe YAML."""
    seq_len: PositiveInt
    """Training sequence length; packed samples are exactly this long."""
    tokens: Count
    """Token budget of the curated mixture (accepts suffixes: '25T')."""
