"""Where the commands that show progress draw it: ``--log-format`` and the stderr console.

Apart from :mod:`factory.cli.output` so that ``factory validate``, which shows no
progress, does not import rich.
"""

from __future__ import annotations

from typing import Annotated

import typer
from rich.console import Console

from factory.progress import LogFormat

__all__ = ["LogFormatOption", "progress_console"]

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
