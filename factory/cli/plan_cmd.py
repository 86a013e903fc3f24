"""``factory plan``: parameters, FLOPs, memory per rank and the layout of a blueprint."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from factory.cli.app import app
from factory.cli.output import print_diagnostics
from factory.cli.validate_cmd import SetOption


@app.command()
def plan(
    target: Annotated[str, typer.Argument(help="Preset name or blueprint path.")],
    overrides: SetOption = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the plan as JSON.")] = False,
    proxy: Annotated[
        bool, typer.Option("--proxy", help="Plan the blueprint's CPU proxy (factory.proxy).")
    ] = False,
) -> None:
    """Plan a blueprint: exact parameter counts, FLOPs per token, memory per rank."""
    from factory.loading.load import load
    from factory.planner.plan import plan as make_plan

    loaded = load(target, overrides or [])
    print_diagnostics(loaded.warnings)
    blueprint = loaded.blueprint
    if proxy:
        from factory.proxy import derive_proxy

        blueprint = derive_proxy(blueprint)
    result = make_plan(blueprint).to_dict()
    if as_json:
        typer.echo(json.dumps(result, indent=2))
        return
    from rich.console import Console

    from factory.planner.report import rich_tables

    console = Console()
    console.print(f"[bold]{blueprint.meta.name}[/bold]: {blueprint.meta.description}")
    for table in rich_tables(result):
        console.print(table)
