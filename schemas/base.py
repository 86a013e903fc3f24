"""The base class every blueprint section derives from, and shared field types."""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, WithJsonSchema

__all__ = ["Count", "PositiveInt", "Section"]


class Section(BaseModel):
    """A blueprint section: unknown keys are errors, and values never change after validation.

    Attribute docstrings become JSON Schema descriptions, so editors show them
    as hover text when a blueprint is checked against ``schemas/*.schema.json``.
    """

    model_config = ConfigDict(
        extra="forbid",
        frozen=True,
        use_attribute_docstrings=True,
        validate_default=True,
    )


PositiveInt = Annotated[int, Field(ge=1)]

_SUFFIXES = {"K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12}
_COUNT_RE = re.compile(r"^\s*([0-9][0-9_]*(?:\.[0-9]+)?)\s*([KMBGT]?)\s*$", re.IGNORECASE)


def _parse_count(value: object) -> object:
    """Accept ``25T``, ``8.2T``, ``1_000_000`` or a plain integer for large counts.

    Token budgets run to 10^13; writing them out invites a missing zero.
    Anything that is not a recognisable count is passed through for pydantic
    to reject with its usual message.
    """
    if isinstance(value, str):
        match = _COUNT_RE.match(value)
        if match is None:
            return value
        number, suffix = match.groups()
        scaled = float(number.replace("_", "")) * _SUFFIXES.get(suffix.upper(), 1)
        if scaled != int(scaled):
            raise ValueError(f"{value!r} is not a whole number")
        return int(scaled)
    return value


Count = Annotated[
    int,
    BeforeValidator(_parse_count),
    Field(ge=1),
    WithJsonSchema(
        {
            "anyOf": [
                {"type": "integer", "minimum": 1},
                {"type": "string", "pattern": r"^\s*[0-9][0-9_]*(\.[0-9]+)?\s*[KMBGTkmbgt]?\s*$"},
            ],
            "examples": [8192, "25T", "1.5B"],
        }
    ),
]
"""A positive integer that may be written with a K/M/B/T suffix."""
