"""How the CLI reports problems: ``file:line: path: message`` on stderr, exit status 2.

``factory validate`` also speaks to CI: JSON on stdout, or GitHub Actions
annotations on stdout (the stream the runner reads workflow commands from).
The commands that show progress share ``--log-format`` (``factory.cli.progress_output``).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable
from enum import StrEnum

import typer

from factory.diagnostic_formats import as_record, github_annotation
from factory.errors import BlueprintError, Diagnostic

__all__ = [
    "EXIT_INVALID",
    "DiagnosticFormat",
    "fail",
    "print_diagnostics",
    "print_json",
]

EXIT_INVALID = 2


class DiagnosticFormat(StrEnum):
    """How ``factory validate`` prints what it finds."""

    text = "text"
    json = "json"
    github = "github"


def print_diagnostics(
    diagnostics: Iterable[Diagnostic], how: DiagnosticFormat = DiagnosticFormat.text
) -> None:
    """Print each diagnostic now; JSON is printed once, for every target, by print_json."""
    for diagnostic in diagnostics:
        if how is DiagnosticFormat.github:
            print(github_annotation(diagnostic), flush=True)
        elif how is DiagnosticFormat.text:
            print(diagnostic.format(), file=sys.stderr)


def print_json(diagnostics: Iterable[Diagnostic]) -> None:
    """Every diagnostic as one JSON array of objects on stdout."""
    print(json.dumps([as_record(d) for d in diagnostics], indent=2))


def fail(error: BlueprintError) -> typer.Exit:
    """Print every diagnostic of ``error`` and return the exit to raise."""
    print_diagnostics(error.diagnostics)
    return typer.Exit(EXIT_INVALID)
