"""Bind a source's typed ``steps`` (schemas/data_recipe.py) to the functions that run them."""

from __future__ import annotations

from dataclasses import dataclass

from factory.data.steps.chat_template import ChatTemplate
from factory.data.steps.filter_registry import Check
from factory.data.steps.filters import FILTERS
from factory.data.steps.formatting import Formatter, formatter
from factory.schemas.data_recipe import SourceConfig

__all__ = ["Chain", "build_chain"]


@dataclass(frozen=True)
class Chain:
    """A source's format step and its filters, in recipe order, each with its ``kind``."""

    format_name: str
    format: Formatter
    filters: tuple[tuple[str, Check], ...]


def build_chain(source: SourceConfig, seed: int, template: ChatTemplate | None = None) -> Chain:
    """``template`` is the recipe's chat template (None: the built-in format)."""
    first, *rest = source.steps
    # The steps are the filters' parameters as validated: nothing is copied or dropped.
    filters = tuple((step.kind, FILTERS[step.kind].bind(step)) for step in rest)
    return Chain(first.kind, formatter(first, seed, template), filters)  # type: ignore[arg-type]
