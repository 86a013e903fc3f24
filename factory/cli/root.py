"""The root ``factory`` Typer app, which every command module registers its command on.

It lives apart from :mod:`factory.cli.app` so that the command modules can
import it while ``app.py`` imports every command module at the top.
"""

from __future__ import annotations

import typer

__all__ = ["app"]

app = typer.Typer(
    name="factory",
    help="Blueprints in: training graphs, plans, exports and data shards out.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
