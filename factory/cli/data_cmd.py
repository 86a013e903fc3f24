"""``factory data build | verify | inspect``: curated, deterministic, resumable shards."""

from __future__ import annotations

import re
from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

import factory
from factory.cli.output import EXIT_INVALID
from factory.cli.progress_output import LogFormatOption, progress_console
from factory.cli.root import app
from factory.data.build_refusals import BuildRefused, nothing_survived
from factory.data.shards.energon_index import META_DIR, check_energon_index
from factory.data.shards.heldout import empty_splits, heldout_sets
from factory.data.shards.manifest import ManifestError, verify
from factory.data.token_shares import inspect_table, write_share_plot
from factory.progress import LogFormat, RichProgress
from factory.schemas.base import MAX_SEQ_LEN


class Executor(StrEnum):
    """Where ``factory data build`` runs its stages (``factory.data.build_job.EXECUTORS``)."""

    local = "local"
    ray = "ray"


data_app = typer.Typer(help="Build, verify and inspect curated data shards.", no_args_is_help=True)
app.add_typer(data_app, name="data")


@data_app.command("build")
def build_cmd(
    recipe: Annotated[str, typer.Argument(help="Recipe name (e.g. nano) or a recipe YAML path.")],
    out: Annotated[Path, typer.Option("--out", help="Output folder.")],
    workers: Annotated[
        int,
        typer.Option(
            "--workers",
            min=1,
            help="Worker processes (with --executor ray and no cluster: the local Ray "
            "instance's CPUs; 1 means all).",
        ),
    ] = 1,
    executor: Annotated[
        Executor,
        typer.Option(
            "--executor",
            help="local: a process pool here. ray: Ray tasks on --address, RAY_ADDRESS, "
            "or a Ray instance started here (pip install 'factory[scale]').",
        ),
    ] = Executor.local,
    address: Annotated[
        str | None,
        typer.Option(
            "--address",
            help="Ray cluster address (ray only); --out must be a path every node sees.",
        ),
    ] = None,
    seq_len: Annotated[
        int | None,
        typer.Option(
            "--seq-len",
            min=1,
            max=MAX_SEQ_LEN,
            help="Pack to this many tokens instead of the recipe's packing.seq_len (a stage's or "
            "a proxy's sequence length).",
        ),
    ] = None,
    allow_empty: Annotated[
        bool,
        typer.Option(
            "--allow-empty",
            help="Publish a build that no document survives (0 shards) instead of refusing it.",
        ),
    ] = False,
    log_format: LogFormatOption = LogFormat.auto,
) -> None:
    """Curate a recipe's sources into webdataset shards Energon loads.

    Resumable: rerun after a crash. Both executors write the same bytes. One build at a
    time per --out; a rerun re-checks the shards it keeps. A build with no surviving
    document exits 2 (see --allow-empty).
    """
    if re.match(r"[A-Za-z][A-Za-z0-9+.-]*:/", str(out)):
        raise typer.BadParameter(
            "object-store URLs are not supported: builds publish files by rename; mount the "
            "bucket (or use a shared file system) and pass its path",
            param_hint="--out",
        )
    if address is not None and executor is not Executor.ray:
        raise typer.BadParameter("--address needs --executor ray", param_hint="--address")
    try:
        console = progress_console(log_format)
        with RichProgress(console, log_format=log_format) as progress:
            manifest = factory.data.build(  # imports numpy when it runs
                recipe,
                out,
                workers=workers,
                seq_len=seq_len,
                progress=progress,
                executor=executor.value,
                address=address,
                allow_empty=allow_empty,
            )
    except BuildRefused as exc:
        typer.echo(f"factory: {exc}", err=True)
        raise typer.Exit(EXIT_INVALID) from None
    if not manifest["shards"]:
        typer.secho(
            f"warning: {out}: built 0 shards, {nothing_survived(manifest)}; "
            "training on this folder will refuse it",
            err=True,
            fg="yellow",
        )
    for name in empty_splits(manifest):
        typer.secho(
            f"warning: {out}: source {name!r} held out no document: its split is too small "
            "for its documents (raise the fraction, or give tokens)",
            err=True,
            fg="yellow",
        )
    tokens = sum(s["after"]["tokens"] for s in manifest["sources"].values())
    held = f"; held-out sets: {', '.join(manifest['heldout'])}" if manifest["heldout"] else ""
    typer.echo(
        f"built {out}: {len(manifest['shards'])} shards, {manifest['packing']['samples']} samples, "
        f"{tokens:,} tokens from {len(manifest['sources'])} sources{held}"
    )


@data_app.command("verify")
def verify_cmd(directory: Annotated[Path, typer.Argument(help="A built data folder.")]) -> None:
    """Check a data folder's shards and index against its manifest.

    Re-hashes every shard against manifest.json and re-derives Energon's index from the
    tars, in the folder and in each held-out set it lists (heldout/CATEGORY); exits 1 naming
    each bad shard and each missing or stale index file, 2 for a folder without a readable
    manifest.
    """
    try:
        folders = [directory, *(s.folder for s in heldout_sets(directory).values())]
        bad = [shard for folder in folders for shard in _bad_shards(directory, folder)]
    except ManifestError as exc:
        typer.echo(f"factory: {exc}", err=True)
        raise typer.Exit(EXIT_INVALID) from None
    for name in bad:
        typer.echo(f"bad shard: {name}", err=True)
    # Only folders built with Energon output have .nv-meta; its index must match
    # the tars, or Energon's loader reads the wrong bytes or refuses the folder.
    index = [
        problem if folder == directory else f"{folder.relative_to(directory)}: {problem}"
        for folder in folders
        if (folder / META_DIR).is_dir()
        for problem in check_energon_index(folder)
    ]
    for problem in index:
        typer.echo(f"bad energon index: {problem}", err=True)
    if bad or index:
        raise typer.Exit(1)
    typer.echo(f"ok: {directory}")


def _bad_shards(directory: Path, folder: Path) -> list[str]:
    """``folder``'s bad shards, named relative to ``directory`` (the build verified)."""
    prefix = "" if folder == directory else f"{folder.relative_to(directory).as_posix()}/"
    return [f"{prefix}{name}" for name in verify(folder)]


@data_app.command("inspect")
def inspect_cmd(
    directory: Annotated[Path, typer.Argument(help="A built data folder.")],
    png: Annotated[Path | None, typer.Option("--png", help="Where to draw token shares.")] = None,
) -> None:
    """Show token shares per category and per source.

    A table, and a PNG (default DIR/shares.png).
    """
    try:
        rows = inspect_table(directory)
    except ManifestError as exc:
        typer.echo(f"factory: {exc}", err=True)
        raise typer.Exit(EXIT_INVALID) from None

    table = Table(title=Text(f"{directory}: token shares"))
    for column, justify in (
        ("level", "left"),
        ("name", "left"),
        ("category", "left"),
        ("documents", "right"),
        ("tokens", "right"),
        ("share", "right"),
    ):
        table.add_column(column, justify=justify)  # type: ignore[arg-type]
    for level, name, category, documents, tokens, share in rows:
        names = (Text(level), Text(name), Text(category))  # a recipe's names, not markup
        table.add_row(*names, f"{documents:,}", f"{tokens:,}", f"{share:.1%}")
    Console().print(table)
    target = png or directory / "shares.png"
    write_share_plot(directory, target)
    typer.echo(f"wrote {target}")
