"""``factory export hf``/``megatron`` and ``factory import hf``: other engines' formats."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

import typer

import factory
from factory.cli.output import EXIT_INVALID
from factory.cli.root import app
from factory.cli.validate_cmd import SetOption
from factory.exports.hf_config import ExportError
from factory.exports.hf_import import blueprint_yaml_from_hf, has_weights
from factory.exports.hf_stage import (
    UnknownAverage,
    UnknownStage,
    copy_run_model,
    is_run_folder,
    stage_of,
)
from factory.exports.megatron import MegatronExportError, export_megatron
from factory.io import atomic_write_text
from factory.proxy import derive_proxy

export_app = typer.Typer(
    help="Export a blueprint's model for another engine.", no_args_is_help=True
)
import_app = typer.Typer(
    help="Create a blueprint from another engine's checkpoint.", no_args_is_help=True
)
app.add_typer(export_app, name="export")
app.add_typer(import_app, name="import")


@export_app.command("hf")
def export_hf_cmd(
    target: Annotated[
        str, typer.Argument(help="Preset name, blueprint path or a training's run folder.")
    ],
    out: Annotated[Path, typer.Option("--out", help="Output folder.")],
    stage: Annotated[
        str | None,
        typer.Option("--stage", help="The program's stage to export (default: the final one)."),
    ] = None,
    averaged: Annotated[
        str | None,
        typer.Option(
            "--averaged",
            help="A run folder's averaged checkpoint to export (RUN/averaged/NAME, "
            "`factory average`) instead of its trained model.",
        ),
    ] = None,
    proxy: Annotated[bool, typer.Option("--proxy", help="Export the CPU proxy model.")] = False,
    seed: Annotated[int, typer.Option("--seed", help="Initialisation seed.")] = 0,
    weights: Annotated[
        Path | None,
        typer.Option("--weights", exists=True, help="Checkpoint (.safetensors, .pt or HF folder)."),
    ] = None,
    overrides: SetOption = None,
) -> None:
    """Write a Hugging Face checkpoint (NemotronHForCausalLM).

    config.json and model.safetensors, which transformers loads. For a run folder, the model
    its training wrote for --stage (RUN/<stage>/model/, or RUN/model/ without stages), or with
    --averaged NAME that stage's averaged checkpoint (`factory average`); for a blueprint with
    stages, that stage's blueprint.
    """
    run = Path(target)
    if run.is_dir() and is_run_folder(run):
        flags = {"--proxy": proxy, "--weights": weights, "--set": overrides}
        given = [flag for flag, used in flags.items() if used]
        if given:
            typer.echo(f"{target}: {', '.join(given)}: a run folder holds its model", err=True)
            raise typer.Exit(EXIT_INVALID)
        try:
            source = copy_run_model(run, out, stage, averaged)
        except UnknownStage as exc:
            typer.echo(f"{target}: --stage: {exc}", err=True)
            raise typer.Exit(EXIT_INVALID) from None
        except UnknownAverage as exc:
            typer.echo(f"{target}: --averaged: {exc}", err=True)
            raise typer.Exit(EXIT_INVALID) from None
        except ExportError as exc:
            typer.echo(f"{target}: {exc}", err=True)
            raise typer.Exit(EXIT_INVALID) from None
        typer.echo(f"wrote {out}/config.json and {out}/model.safetensors (from {source})")
        return
    if averaged is not None:
        typer.echo(f"{target}: --averaged: only a run folder has averaged checkpoints", err=True)
        raise typer.Exit(EXIT_INVALID)
    bp = factory.load_blueprint(target, overrides or [])
    try:
        bp = stage_of(bp, stage).blueprint
    except UnknownStage as exc:
        typer.echo(f"{target}: --stage: {exc}", err=True)
        raise typer.Exit(EXIT_INVALID) from None
    if proxy:
        bp = derive_proxy(bp)
    try:
        factory.export_hf(bp, out, seed=seed, weights=weights)  # imports torch when it runs
    except ExportError as exc:
        typer.echo(f"{target}: model: {exc}", err=True)
        raise typer.Exit(EXIT_INVALID) from None
    typer.echo(f"wrote {out}/config.json and {out}/model.safetensors")


@export_app.command("megatron")
def export_megatron_cmd(
    target: Annotated[str, typer.Argument(help="Preset name or blueprint path.")],
    out: Annotated[Path, typer.Option("--out", help="Output folder.")],
    allow_unexpressed: Annotated[
        bool,
        typer.Option(
            "--allow-unexpressed",
            help="Export anyway, listing in README.md what Megatron cannot express.",
        ),
    ] = False,
    data: Annotated[
        Literal["megatron", "energon"],
        typer.Option("--data", help="Training data format: megatron (.bin/.idx) or energon."),
    ] = "megatron",
    overrides: SetOption = None,
) -> None:
    """Write a Megatron-Bridge training recipe.

    recipe.py, overrides.yaml, launch.sh, hf/, README.md and, for per-module formats,
    quant_recipe.yaml; for a blueprint with stages, one such folder per stage, chained by
    checkpoint, with README.md and launch.sh for the chain.
    """
    bp = factory.load_blueprint(target, overrides or [])
    try:
        export_megatron(bp, out, allow_unexpressed=allow_unexpressed, data_format=data)
    except MegatronExportError as exc:
        typer.echo(f"{target}: cannot export to Megatron-Bridge:", err=True)
        for path, why in exc.fields:
            typer.echo(f"  {path}: {why}", err=True)
        raise typer.Exit(EXIT_INVALID) from None
    if bp.stages is None:
        typer.echo(f"wrote {out}/recipe.py, overrides.yaml, launch.sh, README.md")
    else:
        names = ", ".join(stage.name for stage in bp.stages)
        typer.echo(f"wrote {out}/README.md, launch.sh and a recipe folder per stage: {names}")


@import_app.command("hf")
def import_hf_cmd(
    directory: Annotated[
        Path,
        typer.Argument(
            exists=True,
            file_okay=False,
            help="Folder with config.json and, to start from them, *.safetensors weights.",
        ),
    ],
    out: Annotated[Path, typer.Option("--out", help="Blueprint YAML to write.")],
) -> None:
    """Write a blueprint reproducing a NemotronH checkpoint.

    The blueprint starts from that checkpoint's weights.
    """
    atomic_write_text(out, blueprint_yaml_from_hf(directory))
    typer.echo(f"wrote {out}")
    if not has_weights(directory):
        typer.echo(
            f"note: {directory}: no *.safetensors, so the blueprint has no init.checkpoint "
            "and starts from random weights",
            err=True,
        )
