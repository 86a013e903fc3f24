"""``factory schema``: write the JSON Schema files that editors use to check blueprints."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from factory.cli.root import app
from factory.json_schema import render_schemas, write_schemas


@app.command()
def schema(
    out: Annotated[Path, typer.Option("--out", help="Folder for the *.schema.json files.")] = Path(
        "schemas"
    ),
    check: Annotated[
        bool, typer.Option("--check", help="Write nothing; exit 1 if the files are stale.")
    ] = False,
) -> None:
    """Write blueprint.schema.json and fragment.schema.json."""

    if check:
        stale = [
            name
            for name, text in render_schemas().items()
            if not (out / name).is_file() or (out / name).read_text(encoding="utf-8") != text
        ]
        for name in stale:
            typer.echo(f"{out / name}: stale; run `factory schema --out {out}`", err=True)
        raise typer.Exit(1 if stale else 0)
    for path in write_schemas(out):
        typer.echo(f"wrote {path}")
