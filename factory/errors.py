"""Diagnostics: what is wrong with a blueprint, where, and how to fix it.

Every problem is reported as ``file:line: dotted.path: message``, the format
editors and CI annotators parse. A warning prints the same way with a
``warning:`` prefix and never fails a command.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from factory.dotted_paths import parent_path

__all__ = ["BlueprintError", "Diagnostic", "SourceMap", "did_you_mean"]


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

    def format(self) -> str:
        prefix = "warning: " if self.severity == "warning" else ""
        where = f"{self.file}:{self.line}" if self.line else self.file
        path = self.path or "<root>"
        rule = f" [{self.rule}]" if self.rule else ""
        return _one_line(f"{where}: {path}: {prefix}{self.message}{rule}")


def _one_line(text: str) -> str:
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
        self.default_file = default_file

    def record(self, path: str, file: str, line: int) -> None:
        self._where[path] = (file, line)

    def update(self, other: SourceMap) -> None:
        self._where.update(other._where)

    def paths(self) -> Iterable[str]:
        return self._where.keys()

    def __contains__(self, path: str) -> bool:
        return path in self._where

    def locate(self, path: str) -> tuple[str, int]:
        probe = path
        while probe:
            if probe in self._where:
                return self._where[probe]
            probe = parent_path(probe)
        return self._where.get("", (self.default_file, 0))

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
        file, line = self.locate(path)
        return Diagnostic(path=path, message=message, file=file, line=line, **kwargs)  # type: ignore[arg-type]


def did_you_mean(word: str, candidates: Iterable[str]) -> str:
    """A ' (did you mean 'x'?)' suffix, or '' when nothing is close."""
    matches = difflib.get_close_matches(word, list(candidates), n=1, cutoff=0.6)
    return f" (did you mean {matches[0]!r}?)" if matches else ""


class BlueprintError(Exception):
    """A blueprint that cannot be used; carries every diagnostic found, warnings included."""

    def __init__(self, diagnostics: Sequence[Diagnostic]) -> None:
        self.diagnostics = list(diagnostics)
        errors = [d for d in self.diagnostics if d.severity == "error"]
        super().__init__("\n".join(d.format() for d in errors) or "invalid blueprint")

    @property
    def errors(self) -> list[Diagnostic]:
        return [d for d in self.diagnostics if d.severity == "error"]
