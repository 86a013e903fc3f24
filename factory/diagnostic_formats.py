"""Diagnostics for machines: JSON records and GitHub Actions workflow annotations.

The text form (``file:line: path: message [rule]``) is :meth:`Diagnostic.format`;
CI systems want the same facts as fields, or as ``::error file=...::`` commands
that GitHub shows inline on a pull request.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from factory.errors import Diagnostic, one_line, suggestion_in

__all__ = ["as_record", "github_annotation", "promote_warnings"]

# The title of an annotation whose finding has no rule name (a schema error, a YAML error).
_UNRULED_TITLE = "factory validate"


def promote_warnings(diagnostics: list[Diagnostic]) -> list[Diagnostic]:
    """``diagnostics`` with every warning made an error (``--strict``)."""
    return [
        Diagnostic(d.path, d.message, d.file, d.line, "error", d.rule, d.column)
        for d in diagnostics
    ]


def as_record(diagnostic: Diagnostic) -> dict[str, Any]:
    """One diagnostic as a JSON object; unknown line and column are null."""
    return {
        "file": diagnostic.file,
        "line": diagnostic.line or None,
        "column": diagnostic.column or None,
        "path": diagnostic.path,
        "rule": diagnostic.rule or None,
        "severity": diagnostic.severity,
        "message": diagnostic.message,
        "did_you_mean": suggestion_in(diagnostic.message),
    }


def github_annotation(diagnostic: Diagnostic) -> str:
    """A ``::error ...::message`` (or ``::warning``) workflow command for GitHub Actions."""
    properties = []
    text = f"{diagnostic.path or '<root>'}: {diagnostic.message}"
    file = _workspace_path(diagnostic.file)
    if file is None:  # no place to pin it on: the message says where
        text = f"{diagnostic.file}: {text}"
    else:
        properties.append(f"file={_escape_property(file)}")
        if diagnostic.line:
            properties.append(f"line={diagnostic.line}")
            if diagnostic.column:
                properties.append(f"col={diagnostic.column}")
    properties.append(f"title={_escape_property(diagnostic.rule or _UNRULED_TITLE)}")
    command = f"::{diagnostic.severity} {','.join(properties)}::{_escape_data(text)}"
    # What GitHub's escapes leave (a tab, a file name's undecodable byte) is escaped as the
    # text form escapes it: stdout may refuse to encode it, and a command is one line.
    return one_line(command)


def _workspace_path(file: str) -> str | None:
    """``file`` as GitHub places annotations (relative to the checkout, where the job
    runs), or None when it is no file at all (``--set``, a preset's inline source)."""
    path = Path(file)
    if not path.is_file():
        return None
    if not path.is_absolute():
        return path.as_posix()
    relative = os.path.relpath(path, Path.cwd())
    return path.as_posix() if relative.startswith("..") else Path(relative).as_posix()


def _escape_data(text: str) -> str:
    """The escapes GitHub's workflow-command parser undoes in a message."""
    return text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def _escape_property(text: str) -> str:
    """The escapes it undoes in a property value, where ':' and ',' are separators."""
    return _escape_data(text).replace(":", "%3A").replace(",", "%2C")
