"""How the CLI reports problems: ``file:line: path: message`` on stderr, exit status 2."""

from __future__ import annotations

import sys
from collections.abc import Iterable

import typer

from factory.errors import BlueprintError, Diagnostic

__all__ = ["EXIT_INVALID", "fail", "print_diagnostics"]

EXIT_INVALID = 2


def print_diagnostics(diagnostics: Iterable[Diagnostic]) -> None:
    for diagnostic in diagnostics:
        print(diagnostic.format(), file=sys.stderr)


def fail(error: BlueprintError) -> typer.Exit:
    """Print every diagnostic of ``error`` and return the exit to raise."""
    print_diagnostics(error.diagnostics)
    return typer.Exit(EXIT_INVALID)
