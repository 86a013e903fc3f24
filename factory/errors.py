"""Diagnostics: what is wrong with a blueprint, where, and how to fix it.

Every problem is reported as ``file:line: dotted.path: message``, the format
editors and CI annotators parse. A warning prints the same way with a
``warning:`` prefix and never fails a command.
"""

from __future__ import annotations

import ast
import difflib
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from factory.dotted_paths import parent_path

__all__ = ["BlueprintError", "Diagnostic", "SourceMap", "did_you_mean", "one_line", "suggestion_in"]


@dataclass(frozen=True)
class Diagnostic:
    """One finding about one blueprint value."""

    path: str
    """Dotted path of the offending value, e.g. 'parallelism.tp'."""
    message: str
    file: str = "<blueprint>"
    line: int = 0
    severity: Literal["error", "warning"] = "error"
    rule: str = ""
    """Name of the rule that fired, for cross-field checks."""
    column: int = 0
    """1-based column of the value in ``file``; 0 when unknown (an override, a whole file)."""

    def format(self) -> str:
        prefix = "warning: " if self.severity == "warning" else ""
        where = f"{self.file}:{self.line}" if self.line else self.file
        path = self.path or "<root>"
        rule = f" [{self.rule}]" if self.rule else ""
        return one_line(f"{where}: {path}: {prefix}{self.message}{rule}")


def one_line(text: str) -> str:
    """Escape control characters: one diagnostic is one line, whatever value it quotes."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode() for c in text)


class SourceMap:
    """Where each dotted path of a composed blueprint was last written.

    Lookups walk up to the nearest written parent, so a missing field is
    reported at the line of the section that should hold it.
    """

    def __init__(self, default_file: str = "<blueprint>") -> None:
        self._where: dict[str, tuple[str, int]] = {}
        self._columns: dict[str, int] = {}
        self.default_file = default_file

    def record(self, path: str, file: str, line: int, column: int = 0) -> None:
        self._where[path] = (file, line)
        self._columns[path] = column

    def update(self, other: SourceMap) -> None:
        self._where.update(other._where)
        self._columns.update(other._columns)

    def paths(self) -> Iterable[str]:
        return self._where.keys()

    def __contains__(self, path: str) -> bool:
        return path in self._where

    def locate(self, path: str) -> tuple[str, int]:
        return self._nearest(path)[:2]  # type: ignore[return-value]

    def _nearest(self, path: str) -> tuple[str, int, int]:
        """File, line and column of ``path`` or of its nearest written parent."""
        probe = path
        while probe:
            if probe in self._where:
                return (*self._where[probe], self._columns.get(probe, 0))
            probe = parent_path(probe)
        file, line = self._where.get("", (self.default_file, 0))
        return file, line, self._columns.get("", 0)

    def locate_missing(self, path: str) -> tuple[str, int]:
        """Where a missing ``path`` belongs: its nearest parent written in the file itself.

        ``default_file`` is the file the user named; a section that only a
        fragment wrote must not send them to edit the shared fragment (nor
        hide which file is incomplete, as a truncated one is).
        """
        probe = parent_path(path)
        while probe:
            where = self._where.get(probe)
            if where is not None and where[0] == self.default_file:
                return where
            probe = parent_path(probe)
        where = self._where.get("")
        return (
            where if where is not None and where[0] == self.default_file else (self.default_file, 1)
        )

    def diagnostic(self, path: str, message: str, **kwargs: object) -> Diagnostic:
        file, line, column = self._nearest(path)
        return Diagnostic(path, message, file, line, column=column, **kwargs)  # type: ignore[arg-type]


def did_you_mean(word: str, candidates: Iterable[str]) -> str:
    """A ' (did you mean 'x'?)' suffix, or '' when nothing is close."""
    matches = difflib.get_close_matches(word, list(candidates), n=1, cutoff=0.6)
    return f" (did you mean {matches[0]!r}?)" if matches else ""


# What did_you_mean writes: the suggestion is a Python string literal (repr).
_SUGGESTION = re.compile(r""" \(did you mean ('(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*")\?\)""")


def suggestion_in(message: str) -> str | None:
    """The name a :func:`did_you_mean` suffix in ``message`` proposes, or None.

    Messages carry the hint as text (every command prints it); machine-readable
    reports need the name on its own.
    """
    match = _SUGGESTION.search(message)
    return ast.literal_eval(match.group(1)) if match else None


class BlueprintError(Exception):
    """A blueprint that cannot be used; carries every diagnostic found, warnings included."""

    def __init__(self, diagnostics: Sequence[Diagnostic]) -> None:
        self.diagnostics = list(diagnostics)
        errors = [d for d in self.diagnostics if d.severity == "error"]
        super().__init__("\n".join(d.format() for d in errors) or "invalid blueprint")

    @property
    def errors(self) -> list[Diagnostic]:
        return [d for d in self.diagnostics if d.severity == "error"]
