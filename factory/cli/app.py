"""The ``factory`` command.

Each subcommand lives in its own module and registers on :data:`app`
(``factory.cli.root``), which imports a command's module only when that command
runs or ``--help`` lists it. Bad input never shows a traceback: it prints
``file:line: path: message`` lines and exits with status 2.
"""

from __future__ import annotations

import os
import sys

import typer

from factory.cli.output import print_diagnostics
from factory.cli.root import app
from factory.errors import BlueprintError
from factory.io import DISK_FULL
from factory.rank_process import end_if_rank_process

__all__ = ["app", "main"]

EXIT_USAGE = 2
"""Click's status for usage mistakes: unknown command or option, missing argument."""


def _click_errors() -> tuple[type[Exception], ...]:
    """Click's exception base, and Typer's where Typer vendors its own copy of click.

    Click itself is looked up, not imported: recent Typer releases never load it, and an
    error can only be click's where something did (importing it costs validate 10 ms).
    """
    click = sys.modules.get("click")
    vendored = getattr(getattr(typer, "exceptions", None), "TyperException", None)
    return tuple(base for base in (getattr(click, "ClickException", None), vendored) if base)


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


EXIT_FAILED = 1
"""A command that could not finish for a reason outside the user's input (disk, permissions)."""


def _show_os_error(exc: OSError) -> int:
    """The machine said no (a full disk, a permission, a vanished file): name the path."""
    paths = [str(p) for p in (exc.filename, exc.filename2) if p is not None]
    where = " -> ".join(paths) or "a file"
    cause = exc.strerror or str(exc)
    if exc.errno in DISK_FULL:
        cause = f"the disk is full ({cause})"
    print(_one_line(f"factory: {where}: {cause}"), file=sys.stderr)
    return EXIT_FAILED


def _show_bug(exc: BaseException) -> int:
    """An error factory did not foresee: one line, the traceback only on request."""
    message = str(exc).strip().splitlines()
    first = message[0] if message else ""
    print(_one_line(f"factory: internal error: {type(exc).__name__}: {first}"), file=sys.stderr)
    print("factory: set FACTORY_DEBUG=1 for the traceback", file=sys.stderr)
    return EXIT_FAILED


def _one_line(text: str) -> str:
    return text if text.isprintable() else text.encode("unicode_escape").decode()


def main(argv: list[str] | None = None) -> int:
    """Entry point of the console script; returns the exit status (a process that hosted a
    distributed rank ends here instead: ``factory.rank_process``)."""
    status = _run(argv)
    end_if_rank_process(status)
    return status


def _run(argv: list[str] | None) -> int:
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
    except (SystemExit, GeneratorExit):
        raise
    # Libraries raise BaseException subclasses too (torch's CheckpointException): same boundary.
    except BaseException as exc:
        if isinstance(exc, _click_errors()):
            return _show_click_error(exc)  # type: ignore[arg-type]
        if os.environ.get("FACTORY_DEBUG"):
            raise
        if isinstance(exc, OSError):
            return _show_os_error(exc)
        return _show_bug(exc)
    return result if isinstance(result, int) else 0


if __name__ == "__main__":
    sys.exit(main())
