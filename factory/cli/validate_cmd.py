"""``factory validate``: check blueprints, for CI. Exit 0 when all are valid, else 2."""

from __future__ import annotations

from typing import Annotated

import typer

from factory.cli.app import app
from factory.cli.output import EXIT_INVALID, print_diagnostics
from factory.errors import BlueprintError

SetOption = Annotated[
    list[str] | None,
    typer.Option("--set", help="Override a value: --set parallelism.tp=8 (repeatable)."),
]


@app.command()
def validate(
    targets: Annotated[
        list[str] | None,
        typer.Argument(help="Preset names or blueprint paths; none means every shipped preset."),
    ] = None,
    overrides: SetOption = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="Print problems only.")] = False,
) -> None:
    """Validate blueprints: schema, composition and every cross-field rule."""
    from factory.loading.load import load, preset_names

    failed = 0
    for target in targets or preset_names():
        try:
            loaded = load(target, overrides or [])
        except BlueprintError as exc:
            print_diagnostics(exc.diagnostics)
            failed += 1
            continue
        print_diagnostics(loaded.warnings)
        if not quiet:
            typer.echo(f"ok: {target} ({loaded.source})")
    if failed:
        raise typer.Exit(EXIT_INVALID)
