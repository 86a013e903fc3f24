"""What flows between the curation steps: raw records and formatted documents."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["Document", "RawRecord"]


@dataclass(frozen=True)
class RawRecord:
    """One input record as read, before formatting.

    ``key`` is stable across runs and machines: ``{source}:{file_index}:{line}``
    (line is 1-based for jsonl, the row index for parquet and datasets).
    """

    key: str
    source: str
    category: str
    data: dict[str, Any]


@dataclass(frozen=True)
class Document:
    """A formatted training document.

    ``segments`` are (text, trains) pairs: ``trains`` says whether the tokens of
    that text count in the loss (assistant turns do; system, user and tool turns
    don't; plain text trains entirely). The concatenated text is what dedup and
    decontamination see.
    """

    key: str
    source: str
    category: str
    segments: tuple[tuple[str, bool], ...]
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def text(self) -> str:
        return "".join(text for text, _ in self.segments)
