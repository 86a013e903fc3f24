"""`factory plan`, `factory build` and `factory schema`."""

from __future__ import annotations

import importlib.metadata
import json
from pathlib import Path

import pytest
import yaml
from conftest import PRESETS, REPO
from one_stage import one_stage

import factory
from factory.precision.policy import resolve_policy
from factory.schemas.program import resolve_program


def test_plan_json(cli) -> None:
    status, out, err = cli("plan", "nano", "--json")
    assert status == 0, err
    doc = json.loads(out)
    assert doc["params"]["total"] == 31_577_940_288
    assert doc["params"]["active"] == 3_580_076_352


def test_plan_table_names_the_numbers(cli) -> None:
    status, out, _ = cli("plan", "super", "--stage", "phase1")
    assert status == 0
    assert "123,611,033,088" in out and "12,770,237,440" in out
    assert "Memory of the peak rank" in out


def test_plan_of_bad_blueprint_exits_2(cli) -> None:
    status, out, err = cli("plan", "nano", "--set", "parallelism.ep=7")
    assert status == 2
    assert out == ""
    assert "--set:1: parallelism.ep:" in err


# The training stages are tests/test_report_build_page.py's; these builds leave them out.
NO_TRAINING = ("--skip", "smoke", "--skip", "distributed")


def test_build_writes_resolved_plan_and_report(cli, tmp_path: Path) -> None:
    """A single-stage build, of Nano as one stage (a program's: tests/test_build_program.py)."""
    out, source = tmp_path / "nano", tmp_path / "nano-one-stage.yaml"
    source.write_text(yaml.safe_dump(one_stage("nano").model_dump(mode="json", exclude_none=True)))
    status, _, err = cli("build", str(source), "--out", str(out), *NO_TRAINING)
    assert status == 0, err
    assert sorted(p.name for p in out.iterdir()) == [
        "build.json",
        "data",
        "exports",
        "model_check.json",
        "plan.json",
        "precision.json",
        "report.html",
        "report.md",
        "resolved.yaml",
        "search.json",
    ]
    plan = json.loads((out / "plan.json").read_text())
    assert plan["params"]["total"] == 31_577_940_288
    # the resolved blueprint is complete: it loads on its own, without fragments
    assert factory.load_blueprint(out / "resolved.yaml") == one_stage("nano")
    assert "31,577,940,288" in (out / "report.md").read_text()
    manifest = json.loads((out / "data" / "manifest.json").read_text())
    assert manifest["packing"]["seq_len"] == 8192  # the blueprint's data.seq_len, not the recipe's
    assert not (out / "data" / ".work").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_build_prints_a_folder_named_like_markup_as_it_is(cli, tmp_path: Path) -> None:
    """Paths and results are printed as text: rich would take ``[red]`` for a style."""
    out = tmp_path / "b[red]x"
    skips = [*NO_TRAINING, "--skip", "data", "--skip", "export", "--skip", "model"]
    status, _, err = cli("build", "nano", "--out", str(out), *skips)
    assert status == 0, err
    assert f"-> {out.resolve()} (" in " ".join(err.split())


def test_build_report_draws_every_layer(cli, tmp_path: Path) -> None:
    skips = [*NO_TRAINING, "--skip", "data", "--skip", "export"]
    assert cli("build", "super", "--out", str(tmp_path / "super"), *skips)[0] == 0
    page = (tmp_path / "super" / "report.html").read_text()
    # one cell per layer of the 88-layer stack and of the 2-layer MTP block
    assert page.count('class="layer-cell"') == 88 + 2, page.count('class="layer-cell"')


def test_failed_build_leaves_previous_output_untouched(cli, tmp_path: Path) -> None:
    out = tmp_path / "nano"
    skips = [*NO_TRAINING, "--skip", "data", "--skip", "export"]
    assert cli("build", "nano", "--out", str(out), *skips)[0] == 0
    before = (out / "plan.json").read_bytes()
    status, _, _ = cli("build", "nano", "--out", str(out), "--set", "parallelism.tp=3")
    assert status == 2
    assert (out / "plan.json").read_bytes() == before
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_committed_json_schemas_are_fresh(cli) -> None:
    status, _, err = cli("schema", "--out", str(REPO / "schemas"), "--check")
    assert status == 0, f"stale JSON Schema; run `factory schema --out schemas/`\n{err}"


def test_schema_check_detects_staleness(cli, tmp_path: Path) -> None:
    assert cli("schema", "--out", str(tmp_path))[0] == 0
    assert cli("schema", "--out", str(tmp_path), "--check")[0] == 0
    (tmp_path / "blueprint.schema.json").write_text("{}")
    status, _, err = cli("schema", "--out", str(tmp_path), "--check")
    assert status == 1
    assert "blueprint.schema.json: stale" in err


@pytest.mark.parametrize("name", ["nano", "super", "ultra", "nemotron_h_8b", "nemotron_nano_9b_v2"])
def test_resolved_presets_satisfy_the_json_schema(name: str) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads((REPO / "schemas" / "blueprint.schema.json").read_text())
    jsonschema.validate(factory.load_blueprint(name).model_dump(mode="json"), schema)


def test_fragments_satisfy_the_fragment_schema() -> None:
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads((REPO / "schemas" / "fragment.schema.json").read_text())
    for path in (PRESETS / "base").glob("*.yaml"):
        jsonschema.validate(yaml.safe_load(path.read_text()), schema)


def test_json_schema_rejects_unknown_keys() -> None:
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads((REPO / "schemas" / "blueprint.schema.json").read_text())
    doc = factory.load_blueprint("nano").model_dump(mode="json")
    doc["model"]["hiden_size"] = 1
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(doc, schema)


def test_precision_table_shows_every_name_and_glob_whole_in_80_columns(
    cli, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Piped, rich lays the table out at 80 columns: an identifier is folded onto more lines,
    never cut to 'backbone.layers.0.mixe...', and a glob's [qkv] is text, not a style tag."""
    monkeypatch.setenv("COLUMNS", "80")
    status, out, _ = cli("plan", "ultra", "--stage", "phase1", "--precision")
    assert status == 0
    rows = [line.split("│") for line in out.splitlines() if line.startswith("│")]
    cells = [row for row in rows if len(row) == 6]  # the four-column table, not the shares
    assert "…" not in out and "..." not in out
    assert "*.mixer.[qkv]_proj" in out
    # Each row's module cell, joined over its folded lines, names a linear module in full.
    names, current = [], ""
    for row in cells:
        first, second = row[1].strip(), row[2].strip()
        if second:  # a row starts where the format column is filled
            if current:
                names.append(current)
            current = first
        else:
            current += first
    names.append(current)
    phase1 = resolve_program(factory.load_blueprint("ultra")).stage("phase1").blueprint
    assert names == [row.name for row in resolve_policy(phase1)]


def test_version_prints_the_installed_version(cli) -> None:
    status, out, _ = cli("--version")
    assert status == 0
    assert out.strip() == f"factory {importlib.metadata.version('nemotron-factory')}"


def test_plan_tables_have_no_empty_column(cli) -> None:
    """The Layout rows carry no note: their table has two columns, not an empty third."""
    status, out, _ = cli("plan", "nano", "--stage", "phase1")
    assert status == 0
    boxed = [line for line in out.splitlines() if line.startswith("│")]
    assert boxed and not any("│  │" in line or line.rstrip().endswith("│  │") for line in boxed)
    layout = out[out.index("Layout") :].splitlines()
    assert layout[2].count("│") == 3  # │ world_size │ 32 │


def _command_paths() -> list[tuple[str, ...]]:
    """Every command and group of the ``factory`` CLI, as argument tuples."""
    import click
    import typer

    from factory.cli.app import app

    paths: list[tuple[str, ...]] = []

    def walk(command: click.Command, path: tuple[str, ...]) -> None:
        paths.append(path)
        for name, sub in getattr(command, "commands", {}).items():
            walk(sub, (*path, name))

    walk(typer.main.get_command(app), ())
    return paths


def test_help_reads_as_prose(cli) -> None:
    """Flags show no value placeholder, brackets in help texts are not eaten as markup, and a
    group's listing shows each command's whole first line (click cuts a long one with ...)."""
    for path in _command_paths():
        status, out, _ = cli(*path, "--help")
        assert status == 0, path
        assert "<bool>" not in out, path
        listing = out.partition("Commands:")[2]
        assert not [line for line in listing.splitlines() if line.endswith("...")], path
    _, out, _ = cli("data", "build", "--help")
    assert "'factory[scale]'" in " ".join(out.split())
