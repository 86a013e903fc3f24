"""``factory plan``: parameters, FLOPs, memory per rank, layout, cost and failures of a blueprint,
and of each stage of a program with the program's totals."""

from __future__ import annotations

import json
from collections.abc import Callable
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import typer
import yaml
from rich.console import Console
from rich.table import Table
from rich.text import Text

from factory.checks.validate import LoadedBlueprint, load
from factory.cli.output import EXIT_INVALID, print_diagnostics
from factory.cli.root import app
from factory.cli.validate_cmd import SetOption
from factory.data.shards.manifest import ManifestError
from factory.errors import did_you_mean
from factory.io import atomic_write_text
from factory.layout_search import search_layouts
from factory.planner.program_plan import plan_program, plan_stage
from factory.precision.policy import flops_share, gemm_paths, resolve_policy
from factory.proxy import derive_program_proxy, derive_proxy
from factory.report.plan_text import (
    cost_summary,
    curated_line,
    program_layouts,
    program_summary,
    program_table,
    rich_tables,
)
from factory.report.search_text import search_records, search_table
from factory.schemas.blueprint import Blueprint
from factory.schemas.parallelism import GPU_SPECS
from factory.schemas.program import Program, ProgramStage, resolve_program

GPUType = StrEnum("GPUType", {name: name for name in GPU_SPECS})


@app.command()
def plan(
    target: Annotated[str, typer.Argument(help="Preset name or blueprint path.")],
    overrides: SetOption = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the plan as JSON.")] = False,
    proxy: Annotated[
        bool, typer.Option("--proxy", help="Plan the blueprint's CPU proxy (factory.proxy).")
    ] = False,
    precision: Annotated[
        bool,
        typer.Option("--precision", help="Print the per-module precision table and FLOPs shares."),
    ] = False,
    search: Annotated[
        bool,
        typer.Option(
            "--search",
            help="Rank every layout that validates and fits on --gpus GPUs by predicted "
            "tokens/s per GPU (docs/performance.md) and print the ten fastest.",
        ),
    ] = False,
    gpus: Annotated[int | None, typer.Option("--gpus", min=1, help="GPUs to search on.")] = None,
    gpu: Annotated[
        GPUType | None,
        typer.Option("--gpu", help="GPU type to search on (default: the blueprint's)."),
    ] = None,
    out: Annotated[
        Path | None,
        typer.Option("--out", help="With --search: write the fastest layout's blueprint here."),
    ] = None,
    data: Annotated[
        Path | None,
        typer.Option(
            "--data",
            help="Built data (factory train --data's folder, or a run's data/; a program's "
            "stages under <stage>/): each stage's epochs over it.",
        ),
    ] = None,
    stage: Annotated[
        str | None,
        typer.Option(
            "--stage",
            help="Plan, search or show the precision of this stage of a program alone "
            "(a program's --search and --precision need it).",
        ),
    ] = None,
) -> None:
    """Count a blueprint's parameters, FLOPs, memory per rank and cost.

    The counts are exact (the model's own tensors, on no device); nothing is trained.
    A program (a blueprint with ``stages``) is planned stage by stage, with its totals.
    """
    loaded = load(target, overrides or [])
    print_diagnostics(loaded.warnings)
    program = resolve_program(loaded.blueprint)
    searching = search or gpus is not None or gpu is not None or out is not None
    if stage is None and program.declared and (precision or searching):
        # Each stage has its own sequence length, batch and layout, and the first is rarely
        # the one in question (the long-context stage is): no guess, a choice.
        what = "--search" if searching else "--precision"
        raise typer.BadParameter(
            f"{what} works on one stage of a program; name it with --stage "
            f"({', '.join(program.names)})"
        )
    shrink = _proxy_of(program) if proxy else None
    if stage is None and program.declared:
        planned = _reading_data(lambda: plan_program(program, shrink, data).to_dict())
        _print_program(loaded, planned, proxy, as_json)
        return
    chosen = _stage(program, stage) if stage is not None else program.final
    blueprint = chosen.blueprint
    if shrink is not None:
        blueprint = shrink(blueprint)
    if precision:
        _print_precision(blueprint, as_json)
        return
    if searching:
        where = chosen if program.declared else None
        _search(blueprint, where, search, gpus, gpu.value if gpu else None, out, as_json)
        return
    result = _reading_data(lambda: plan_stage(chosen, shrink, data).alone_dict())
    if as_json:
        typer.echo(json.dumps(result, indent=2))
        return

    console = Console()
    console.print(Text.assemble((blueprint.meta.name, "bold"), f": {blueprint.meta.description}"))
    for table in rich_tables(result, cpu_proxy=proxy):
        console.print(table)
    console.print(cost_summary(result, cpu_proxy=proxy), highlight=False)
    if "curated" in result:
        console.print(
            curated_line(result["curated"], chosen.blueprint.data.seq_len), highlight=False
        )


def _stage(program: Program, name: str) -> ProgramStage:
    """Stage ``name`` (a blueprint without stages has one, 'train'); exit 2 otherwise."""
    if name in program.names:
        return program.stage(name)
    typer.echo(
        f"factory: no stage {name!r}{did_you_mean(name, program.names)}; "
        f"the stages: {', '.join(program.names)}",
        err=True,
    )
    raise typer.Exit(EXIT_INVALID)


def _reading_data(make: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """A plan document; exit 2 where ``--data`` lacks a stage's manifest."""
    try:
        return make()
    except ManifestError as exc:
        typer.echo(f"factory: --data: {exc}", err=True)
        raise typer.Exit(EXIT_INVALID) from None


def _proxy_of(program: Program) -> Callable[[Blueprint], Blueprint]:
    """Each stage's blueprint to its proxy as ``factory train --proxy`` trains it: a
    program's stages share one proxy model at the program's proxy sequence lengths."""
    if not program.declared:
        return derive_proxy
    stages = [stage.blueprint for stage in program]
    proxies = {
        id(bp): proxy for bp, proxy in zip(stages, derive_program_proxy(stages), strict=True)
    }
    return lambda bp: proxies[id(bp)]


def _print_program(
    loaded: LoadedBlueprint, planned: dict[str, Any], proxy: bool, as_json: bool
) -> None:
    """Each stage planned alone and the program's totals; the shared model's parameters once
    (FLOPs per token depend on each stage's sequence length: ``--stage NAME`` shows them)."""
    if as_json:
        typer.echo(json.dumps(planned, indent=2))
        return
    # the proxy's name and description where its plan is shown, as one stage's plan says
    meta = (derive_proxy(loaded.blueprint) if proxy else loaded.blueprint).meta
    console = Console()
    console.print(Text.assemble((meta.name, "bold"), f": {meta.description}"))
    parameters = rich_tables(planned["stages"][0]["plan"], cpu_proxy=proxy)[0]
    console.print(parameters)
    console.print(program_table(planned, cpu_proxy=proxy))
    console.print(program_layouts(planned))
    console.print(program_summary(planned, cpu_proxy=proxy), highlight=False)
    for stage in planned["stages"]:
        if "curated" in stage:
            line = curated_line(stage["curated"], stage["seq_len"], stage["name"])
            console.print(line, highlight=False)
    console.print("each stage's whole plan: factory plan BLUEPRINT --stage NAME", highlight=False)


def _search(
    blueprint: Blueprint,
    stage: ProgramStage | None,
    search: bool,
    gpus: int | None,
    gpu: str | None,
    out: Path | None,
    as_json: bool,
) -> None:
    """Search ``blueprint``'s layout; ``stage``: it is that stage of a program, which keeps the
    model (no '|' added to the pattern) and takes its layout under ``stages[i].parallelism``."""
    if not search or gpus is None:
        raise typer.BadParameter("--search needs --gpus N (and takes --gpu, --out)")
    results = search_layouts(blueprint, gpus, gpu, keep_pattern=stage is not None)
    name = blueprint.meta.name + (f" stage {stage.name!r}" if stage is not None else "")
    if not results:
        where = f"{gpus} x {gpu or blueprint.parallelism.gpu}"
        typer.echo(f"factory: no layout of {name} validates and fits on {where}", err=True)
        raise typer.Exit(EXIT_INVALID)
    best = results[0]
    if out is not None:
        atomic_write_text(
            out,
            yaml.safe_dump(
                best.blueprint.model_dump(mode="json", exclude_unset=True), sort_keys=False
            ),
        )
    if as_json:
        typer.echo(json.dumps({"layouts": search_records(results)}, indent=2))
        return
    title = f"{name} on {gpus} x {best.blueprint.parallelism.gpu}: fastest layouts"
    Console().print(search_table(results, title))
    if stage is None:
        typer.echo("best as overrides: " + " ".join(f"--set {o}" for o in best.overrides))
    else:
        changes = ", ".join(
            o.removeprefix("parallelism.").replace("=", ": ") for o in best.overrides
        )
        typer.echo(f"best in the program: stages[{stage.index}].parallelism: {{{changes}}}")
    if out is not None:
        typer.echo(f"wrote {out}" + (f" (stage {stage.name!r} alone)" if stage else ""))


def _print_precision(blueprint: Blueprint, as_json: bool) -> None:
    table = resolve_policy(blueprint)
    shares = flops_share(table)
    if as_json:
        rows = [
            {
                "module": r.name,
                "recipe": r.recipe,
                "reason": r.reason,
                "flops_per_token": r.flops_per_token,
            }
            for r in table
        ]
        paths = gemm_paths(blueprint)
        typer.echo(
            json.dumps({"modules": rows, "flops_share": shares, "gemm_paths": paths}, indent=2)
        )
        return

    grid = Table(title=Text(f"{blueprint.meta.name}: precision per linear module"))
    # Identifiers and globs are folded onto more lines, never cut short, and never markup.
    for column in ("module", "format", "why", "fwd FLOPs/token"):
        right = column.startswith("fwd")
        grid.add_column(column, justify="right" if right else "left", overflow="fold")
    for row in table:
        cells = (row.name, row.recipe, row.reason, f"{row.flops_per_token:,}")
        grid.add_row(*(Text(cell) for cell in cells))
    share = Table(title="share of linear FLOPs per format")
    share.add_column("format")
    share.add_column("share", justify="right")
    for recipe, fraction in shares.items():
        share.add_row(recipe, f"{fraction:.1%}")
    console = Console()
    console.print(grid)
    console.print(share)
    for line in gemm_paths(blueprint):
        typer.echo(f"gemms: {line}")
