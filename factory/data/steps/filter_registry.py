"""The filter registry: a recipe step's ``kind`` -> its section type and its check.

A filter module (``factory/data/steps/filters/<kind>.py``) registers its check
with :func:`register_filter`; ``factory.data.steps.filters`` imports every such
module, and ``chain`` looks a source's filter steps up here. Nothing else names a
filter, so adding one never touches the pipeline.

Every check has the same shape, ``check(record, document, params) -> reason | None``
(None keeps the document), where ``params`` is the recipe step itself (its
section in ``schemas/data_recipe.py``, which declares and documents every
threshold). A check returns the *first* failing reason, so drop counts read as
"why this document went", not as overlapping flags.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from factory.data.steps.records import Document, RawRecord
from factory.schemas.base import Section

__all__ = ["FILTERS", "Check", "FilterFamily", "register_filter"]

Check = Callable[[RawRecord, Document], str | None]
"""A filter bound to its parameters: the first reason to drop the document, or None."""
P = TypeVar("P", bound=Section)


@dataclass(frozen=True)
class FilterFamily(Generic[P]):
    """A filter family: its recipe step type (which is its parameter type) and its check."""

    params: type[P]
    check: Callable[[RawRecord, Document, P], str | None]

    def bind(self, params: P) -> Check:
        """A two-argument check running with ``params``, a validated recipe step.

        Only the step type itself is accepted: parameters come from one
        declaration, so a key the filter does not know has already failed
        validation (``extra="forbid"``) and cannot be silently dropped here.
        """
        if not isinstance(params, self.params):
            raise TypeError(f"{self.params.__name__} expected, got {type(params).__name__}")
        check = self.check

        def bound(record: RawRecord, doc: Document) -> str | None:
            return check(record, doc, params)

        return bound


FILTERS: dict[str, FilterFamily[Any]] = {}
"""Filter families by the ``kind`` they have in a recipe step."""


def register_filter(
    params: type[P],
) -> Callable[
    [Callable[[RawRecord, Document, P], str | None]],
    Callable[[RawRecord, Document, P], str | None],
]:
    """Decorator: ``check`` is the filter of recipe steps of type ``params`` (by its ``kind``)."""
    kind = params.model_fields["kind"].default

    def register(
        check: Callable[[RawRecord, Document, P], str | None],
    ) -> Callable[[RawRecord, Document, P], str | None]:
        if kind in FILTERS:
            raise ValueError(f"a filter of kind {kind!r} is already registered")
        FILTERS[kind] = FilterFamily(params, check)
        return check

    return register
