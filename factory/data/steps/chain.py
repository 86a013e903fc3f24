"""Bind a source's typed ``steps`` (schemas/data_recipe.py) to the functions that run them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from factory.data.steps.filters import FILTERS
from factory.data.steps.formatting import Drop, format_chat, format_text
from factory.data.steps.records import Document, RawRecord
from factory.schemas.data_recipe import ChatFormat, SourceConfig, TextFormat

__all__ = ["Chain", "build_chain"]

FilterFn = Callable[[RawRecord, Document], str | None]


@dataclass(frozen=True)
class Chain:
    format_name: str
    format: Callable[[RawRecord], list[Document] | Drop]
    filters: tuple[tuple[str, FilterFn], ...]


def build_chain(source: SourceConfig, seed: int) -> Chain:
    first, *rest = source.steps
    if isinstance(first, TextFormat):
        field = first.field

        def fmt(record: RawRecord) -> list[Document] | Drop:
            doc = format_text(record, field)
            return doc if isinstance(doc, Drop) else [doc]

    else:
        assert isinstance(first, ChatFormat)
        policy = first.reasoning

        def fmt(record: RawRecord) -> list[Document] | Drop:
            return format_chat(record, policy, record.key, seed)

    # The steps are the filters' parameters as validated: nothing is copied or dropped.
    filters = tuple((step.kind, FILTERS[step.kind].bind(step)) for step in rest)
    return Chain(first.kind, fmt, filters)
