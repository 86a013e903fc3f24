"""``factory build``: validate and plan a blueprint, and write the build folder.

The folder appears whole or not at all: it is assembled in a staging folder
and renamed into place. ``factory train`` trains what it describes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from factory.cli.app import app
from factory.cli.output import print_diagnostics
from factory.cli.validate_cmd import SetOption


def _build_data(bp, out: Path) -> None:
    """The blueprint's data recipe, packed to the blueprint's sequence length."""
    import shutil

    from factory.data.pipeline import build as build_data
    from factory.data.recipe_loading import load_recipe, with_seq_len

    build_data(with_seq_len(load_recipe(bp.data.recipe), bp.data.seq_len), out)
    shutil.rmtree(out / ".work", ignore_errors=True)  # intermediates: not part of a build


@app.command()
def build(
    target: Annotated[str, typer.Argument(help="Preset name or blueprint path.")],
    out: Annotated[
        Path | None, typer.Option("--out", help="Build folder (default: build/NAME).")
    ] = None,
    overrides: SetOption = None,
) -> None:
    """Validate, plan, and write resolved.yaml, plan.json, report.md, report.html and data/."""
    import yaml
    from rich.console import Console

    from factory.io import staged_directory
    from factory.loading.load import load
    from factory.planner.plan import plan as make_plan
    from factory.planner.report import markdown_report
    from factory.planner.report_html import html_report
    from factory.schemas.parallelism import GPU_SPECS

    console = Console(stderr=True)
    with console.status("validating") as status:
        loaded = load(target, overrides or [])
        print_diagnostics(loaded.warnings)
        bp = loaded.blueprint
        status.update("planning")
        result = make_plan(bp).to_dict()
        destination = out or Path("build") / bp.meta.name
        status.update(f"writing {destination}")
        with staged_directory(destination) as staging:
            resolved = yaml.safe_dump(bp.model_dump(mode="json"), sort_keys=False)
            header = f"# Resolved from {loaded.source}; every fragment and override applied.\n"
            (staging / "resolved.yaml").write_text(header + resolved, encoding="utf-8")
            (staging / "plan.json").write_text(
                json.dumps(result, indent=2) + "\n", encoding="utf-8"
            )
            title = f"{bp.meta.name}: {bp.meta.description}".rstrip(": ")
            (staging / "report.md").write_text(markdown_report(result, title), encoding="utf-8")
            capacity = GPU_SPECS[bp.parallelism.gpu].memory_bytes
            page = html_report(result, title, bp.model.mtp_pattern, capacity)
            (staging / "report.html").write_text(page, encoding="utf-8")
            status.update("curating data")
            _build_data(bp, staging / "data")
    params = result["params"]
    console.print(
        f"[green]built[/green] {bp.meta.name} -> {destination}: "
        f"{params['total']:,} parameters ({params['active']:,} active)"
    )
