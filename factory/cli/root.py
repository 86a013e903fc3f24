"""The root ``factory`` Typer app, which every command module registers its command on.

It lives apart from :mod:`factory.cli.app` so that the command modules can
import it while ``app.py`` imports every command module at the top.
"""

from __future__ import annotations

from importlib.metadata import version

import typer

__all__ = ["app"]

app = typer.Typer(
    name="factory",
    help="Blueprints in: training graphs, plans, exports and data shards out.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    # Click's plain help: rich's panels show flags as `--proxy <bool>` and read brackets in
    # help texts ('factory[scale]') as markup.
    rich_markup_mode=None,
)


def _print_version(asked: bool) -> None:
    if asked:
        typer.echo(f"factory {version('nemotron-factory')}")
        raise typer.Exit()


@app.callback()
def _root(
    show_version: bool = typer.Option(
        False,
        "--version",
        callback=_print_version,
        is_eager=True,
        help="Print the installed version and exit.",
    ),
) -> None:
    """Blueprints in: training graphs, plans, exports and data shards out."""
