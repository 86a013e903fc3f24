"""``factory validate``: check blueprints and data recipes, for CI. Exit 0 when all are valid, else 2.

``--format json|github`` prints for machines; ``--strict`` fails on warnings too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, NamedTuple

import typer

from factory.checks.validate import load
from factory.cli.output import EXIT_INVALID, DiagnosticFormat, print_diagnostics, print_json
from factory.cli.root import app
from factory.data.loaded_recipe import load_recipe
from factory.diagnostic_formats import promote_warnings
from factory.errors import BlueprintError, Diagnostic, one_line
from factory.loading.blueprint import preset_names, resolve_source
from factory.loading.documents import RECIPE, document_kind
from factory.loading.shipped import shipped_dir, shipped_names

SetOption = Annotated[
    list[str] | None,
    typer.Option("--set", help="Override a value: --set parallelism.tp=8 (repeatable)."),
]


def _default_targets(with_recipes: bool) -> list[tuple[str, Path | None]]:
    """Every preset and, unless overrides were given (they address blueprints), every recipe."""
    targets: list[tuple[str, Path | None]] = [(name, None) for name in preset_names()]
    if with_recipes:
        folder = shipped_dir("factory.data_recipes")
        names = shipped_names("factory.data_recipes")
        targets += [(f"data recipe {name}", folder / f"{name}.yaml") for name in names]
    return targets


class _Result(NamedTuple):
    source: Path | None
    """The file that was validated, or None when it failed."""
    diagnostics: list[Diagnostic]


def _check(target: str, recipe: Path | None, overrides: list[str]) -> tuple[Path, list[Diagnostic]]:
    """Validate one target; return its file and warnings, or raise BlueprintError."""
    source = recipe or resolve_source(target)
    # A preset name resolves to a shipped blueprint; only a path needs its keys read.
    if recipe is None and source == Path(target) and document_kind(source) == RECIPE:
        recipe = source
    if recipe is None:
        loaded = load(source, overrides)
        return loaded.source, loaded.warnings
    if overrides:
        message = f"--set applies to blueprints; {target} is a data recipe"
        raise BlueprintError([Diagnostic("", message, "--set", 1)])
    return load_recipe(recipe).source, []


FormatOption = Annotated[
    DiagnosticFormat,
    typer.Option(
        "--format",
        help="text: file:line: path: message on stderr; json: one array of objects on stdout; "
        "github: GitHub Actions annotations on stdout.",
    ),
]
StrictOption = Annotated[
    bool, typer.Option("--strict", help="Treat warnings as errors: report them so, exit 2.")
]


def _findings(target: str, recipe: Path | None, overrides: list[str], strict: bool) -> _Result:
    """What validating one target found; with ``strict``, its warnings are errors."""
    try:
        source, diagnostics = _check(target, recipe, overrides)
    except BlueprintError as exc:
        return _Result(None, exc.diagnostics)
    if strict:
        diagnostics = promote_warnings(diagnostics)
    failed = any(d.severity == "error" for d in diagnostics)
    return _Result(None if failed else source, diagnostics)


@app.command()
def validate(
    targets: Annotated[
        list[str] | None,
        typer.Argument(
            help="Preset names, blueprint or data recipe paths; none means every shipped "
            "preset and recipe."
        ),
    ] = None,
    overrides: SetOption = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="Print problems only.")] = False,
    how: FormatOption = DiagnosticFormat.text,
    strict: StrictOption = False,
) -> None:
    """Check blueprints and data recipes (all shipped ones by default).

    Each is checked against its schema, composed from its bases and overrides, and run
    through every cross-field rule; problems print as file:line: path: message.
    """
    chosen = [(t, None) for t in targets] if targets else _default_targets(not overrides)
    failed = 0
    everything: list[Diagnostic] = []
    for target, recipe in chosen:
        result = _findings(target, recipe, overrides or [], strict)
        print_diagnostics(result.diagnostics, how)
        everything += result.diagnostics
        if result.source is None:
            failed += 1
        elif not quiet and how is not DiagnosticFormat.json:
            typer.echo(one_line(f"ok: {target} ({result.source})"))
    if how is DiagnosticFormat.json:
        print_json(everything)
    if failed:
        raise typer.Exit(EXIT_INVALID)
