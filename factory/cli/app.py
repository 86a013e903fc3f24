"""The ``factory`` command.

Each subcommand lives in its own module and registers on :data:`app`
(``factory.cli.root``); importing this module imports every command module, so
they are all registered. Bad input never shows a traceback: it prints
``file:line: path: message`` lines and exits with status 2.
"""

from __future__ import annotations

import os
import sys

import click
import typer

# Importing a command module registers its command on `app`; the order is --help's.
from factory.cli import (  # noqa: F401
    build_cmd,
    data_cmd,
    export_cmd,
    plan_cmd,
    report_cmd,
    schema_cmd,
    train_cmd,
    validate_cmd,
)
from factory.cli.output import print_diagnostics
from factory.cli.root import app
from factory.errors import BlueprintError

__all__ = ["app", "main"]

EXIT_USAGE = 2
"""Click's status for usage mistakes: unknown command or option, missing argument."""


def _click_errors() -> tuple[type[Exception], ...]:
    """Click's exception base, and Typer's where Typer vendors its own copy of click."""
    vendored = getattr(getattr(typer, "exceptions", None), "TyperException", None)
    return (click.ClickException, vendored) if vendored else (click.ClickException,)


def _show_click_error(exc: Exception) -> int:
    """Print a usage mistake as click does (usage, hint, error) and return its exit status."""
    ctx = getattr(exc, "ctx", None)
    command = getattr(ctx, "command", None)
    message = getattr(exc, "message", "")
    if command is not None and message.startswith("No such command"):
        # Name the valid choices: 'factory export megatron' should list the targets.
        choices = ", ".join(command.list_commands(ctx))
        exc.message = f"{message.rstrip('.')}; choose from: {choices}."  # type: ignore[attr-defined]
    show = getattr(exc, "show", None)
    if callable(show):
        show()
    else:
        print(f"factory: {message or exc}", file=sys.stderr)
    return int(getattr(exc, "exit_code", EXIT_USAGE))


def main(argv: list[str] | None = None) -> int:
    """Entry point of the console script; returns the exit status."""
    try:
        # Without standalone mode, click returns an Exit's code instead of raising it.
        result = app(args=argv, prog_name="factory", standalone_mode=False)
    except typer.Exit as exc:
        return exc.exit_code
    except BlueprintError as exc:
        print_diagnostics(exc.diagnostics)
        return 2
    except (typer.Abort, KeyboardInterrupt):
        print("aborted", file=sys.stderr)
        return 130
    except Exception as exc:  # a usage mistake (exit 2, as click), or a bug: no traceback
        if isinstance(exc, _click_errors()):
            return _show_click_error(exc)
        if os.environ.get("FACTORY_DEBUG"):
            raise
        print(f"factory: internal error: {type(exc).__name__}: {exc}", file=sys.stderr)
        print("factory: set FACTORY_DEBUG=1 for the traceback", file=sys.stderr)
        return 1
    return result if isinstance(result, int) else 0


if __name__ == "__main__":
    sys.exit(main())
