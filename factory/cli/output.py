"""How the CLI reports problems: ``file:line: path: message`` on stderr, exit status 2.

``factory validate`` also speaks to CI: JSON on stdout, or GitHub Actions
annotations on stdout (the stream the runner reads workflow commands from).
The commands that show progress share ``--log-format`` (:data:`LogFormatOption`).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable
from enum import StrEnum
from typing import Annotated

import typer
from rich.console import Console

from factory.diagnostic_formats import as_record, github_annotation
from factory.errors import BlueprintError, Diagnostic
from factory.progress import LogFormat

__all__ = [
    "EXIT_INVALID",
    "DiagnosticFormat",
    "LogFormatOption",
    "fail",
    "print_diagnostics",
    "print_json",
    "progress_console",
]

EXIT_INVALID = 2


class DiagnosticFormat(StrEnum):
    """How ``factory validate`` prints what it finds."""

    text = "text"
    json = "json"
    github = "github"


LogFormatOption = Annotated[
    LogFormat,
    typer.Option(
        "--log-format",
        help="Progress as a live display (rich), as timestamped log lines (plain), or rich "
        "in a terminal and plain elsewhere (auto).",
    ),
]


def progress_console(log_format: LogFormat) -> Console:
    """stderr, where progress goes; with ``rich`` it draws even where it is not a terminal."""
    return Console(stderr=True, force_terminal=True if log_format is LogFormat.rich else None)


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
