"""The build report page (``factory.report.build_page``): over a real ``factory build nano`` (every
stage, short training), and over folders made of real pieces with stages skipped and failed."""

from __future__ import annotations

import dataclasses
import html
import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from one_stage import one_stage

import factory
from factory.exports.hf_config import hf_config
from factory.exports.megatron import launch_sh, overrides_yaml
from factory.planner.plan import plan
from factory.precision.policy import flops_share, resolve_policy
from factory.report.build_folder import STAGES, BuildFolder
from factory.report.build_page import write_build_report
from factory.report.build_sections_evaluation import evaluation_section
from factory.report.plan_text import cost_tables
from factory.schemas.blueprint import Blueprint


def _write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1), encoding="utf-8")


def _write_plan_pieces(root: Path, bp: Blueprint) -> dict[str, Any]:
    """resolved.yaml, plan.json, precision.json, model_check.json and the exports."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "resolved.yaml").write_text(
        yaml.safe_dump(bp.model_dump(mode="json")), encoding="utf-8"
    )
    summary = plan(bp).to_dict()
    _write_json(root / "plan.json", summary)
    table = resolve_policy(bp)
    modules = [dataclasses.asdict(row) for row in table]
    _write_json(root / "precision.json", {"modules": modules, "flops_share": flops_share(table)})
    params = summary["params"]["total"]
    _write_json(root / "model_check.json",
                {"device": "meta", "tensors": 1234, "parameters": params, "plan_parameters": params})  # fmt: skip
    _write_json(root / "exports/hf/config.json", hf_config(bp))
    (root / "exports/megatron").mkdir(parents=True)
    (root / "exports/megatron/overrides.yaml").write_text(overrides_yaml(bp), encoding="utf-8")
    (root / "exports/megatron/launch.sh").write_text(launch_sh(bp), encoding="utf-8")
    return summary


def _distributed(root: Path, smoke_losses: list[float], drift: float) -> dict[str, Any]:
    losses = [loss * (1 + drift * (i + 1)) for i, loss in enumerate(smoke_losses)]
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses, smoke_losses, strict=True))
    check = {
        "world_size": 2, "layout": {"dp": 2, "ep": 1, "tp": 1, "pp": 1},
        "steps": list(range(len(losses))), "losses": losses, "smoke_losses": smoke_losses,
        "max_relative_difference": worst, "tolerance": 1e-4, "passed": worst <= 1e-4,
    }  # fmt: skip
    _write_json(root / "distributed.json", check)
    return check


def _stages(root: Path, name: str, statuses: dict[str, str]) -> dict[str, Any]:
    stages = {
        stage: {"status": statuses.get(stage, "done"), "seconds": 0.5 + i,
                "result": f"{stage} result {i}"}
        for i, stage in enumerate(STAGES)
    }  # fmt: skip
    build = {"name": name, "stages": stages}
    _write_json(root / "build.json", build)
    return build


def make_full_build(root: Path) -> Path:
    """``factory build`` of Nano as one stage, every stage run, with short training stages."""
    factory.build(one_stage("nano"), out=root, steps=4, check_steps=1)
    return root


_BUILT: dict[Path, Path] = {}
"""Session builds by pytest's base folder: the browser test imports the fixture, which would
otherwise train a second time."""


@pytest.fixture(scope="session")
def full_build(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.getbasetemp()
    if base not in _BUILT:
        _BUILT[base] = make_full_build(tmp_path_factory.mktemp("build") / "nano")
    return _BUILT[base]


def _page(root: Path) -> str:
    return (root / "report.html").read_text(encoding="utf-8")


def _text(page: str) -> str:
    """The page's visible text and SVG titles, tags stripped."""
    return re.sub(r"<[^>]+>", " ", page.split("<body>", 1)[1])


def test_every_section_is_present_with_numbers_from_the_inputs(full_build: Path) -> None:
    page = _page(full_build)
    for anchor in ("stages", "layers", "memory", "flops", "cost", "model", "precision", "data",
                   "runs", "evaluation", "exports", "artifacts"):  # fmt: skip
        assert f'<section id="{anchor}">' in page, anchor
    summary = json.loads((full_build / "plan.json").read_text())
    text = _text(page)
    assert f"{summary['params']['total']:,}" in text
    record = json.loads((full_build / "build.json").read_text())["stages"]
    assert [record[stage]["status"] for stage in STAGES[:-1]] == ["done"] * (len(STAGES) - 1)
    for stage in STAGES[:-1]:  # the report's own line is recorded after the page is drawn
        assert html.escape(record[stage]["result"], quote=False) in page, stage
    assert record["report"]["status"] == "done"
    assert _stage_row(page, "report") == ["done", "—", "this page"]
    pattern = summary["layout"]["stage_patterns"][0][0]
    assert page.count("<title>layer ") == 2 * len(pattern)  # a cell and a precision strip each
    assert text.count(": MoE ·") == 2 * pattern.count("E")
    manifest = json.loads((full_build / "data/manifest.json").read_text())
    for category, row in manifest["categories"].items():
        assert category in text and f"{row['tokens']:,}" in text
    dropped = sum(n for s in manifest["sources"].values() for n in s["dropped"].values())
    assert f"{dropped:,} documents dropped" in text
    check = json.loads((full_build / "distributed.json").read_text())
    assert f"{check['max_relative_difference']:.3e}" in text and "PASS" in text


def test_the_smoke_runs_plots_are_inlined(full_build: Path) -> None:
    page = _page(full_build)
    images = re.findall(r'<img alt="([^"]+)" src="data:image/png;base64,', page)
    assert images == ["loss.png", "distributed loss", "max_vio.png", "residual_rms.png"]
    assert 'href="smoke/report/report.html"' in page
    kernels = json.loads((full_build / "smoke" / "train.json").read_text())["kernels"]
    assert kernels and "<h3>Smoke run: kernels</h3>" in page
    for line in kernels:  # the run's first lines, on the page
        assert html.escape(line.removeprefix("kernels: ")) in page, line


def test_the_evaluation_shows_held_out_losses_the_average_samples_and_acceptance(
    full_build: Path,
) -> None:
    """The smoke run evaluated its held-out sets while training (curves in its loss plot); the
    evaluate stage's kept checkpoints and their average, each per set, samples of the text
    and the MTP drafts' acceptance are on the page, from ``evaluation.json``."""
    metrics = [json.loads(line) for line in (full_build / "smoke" / "metrics.jsonl").open()]
    evaluations = [m for m in metrics if m["kind"] == "eval"]
    heldout = {c for c in json.loads((full_build / "data/manifest.json").read_text())["heldout"]}
    assert heldout and {m["category"] for m in evaluations} == heldout | {None}
    record = json.loads((full_build / "evaluation.json").read_text())
    assert record["sets"] == sorted(heldout)
    steps = [c["step"] for c in record["checkpoints"]]
    assert steps == [2, 3, 4] and record["averaged"]["steps"] == steps
    assert record["averaged"]["weights"] == [1 / 3] * 3
    recorded = {m["step"]: m["loss"] for m in evaluations if m["category"] is None}
    for checkpoint in record["checkpoints"]:  # factory eval's number is training.eval's
        assert checkpoint["loss"] == pytest.approx(recorded[checkpoint["step"]], rel=1e-9)
    text = _text(_page(full_build))
    for losses in (*record["checkpoints"], record["averaged"]):
        assert f"{losses['loss']:.4f}" in text
        for name, loss in losses["sets"].items():
            assert name in text and f"{loss:.4f}" in text
    assert record["speculative"] is None and len(record["samples"]) == 3  # Nano has no MTP
    for sample in record["samples"]:
        assert html.escape(sample["text"]) in _page(full_build)
    assert not list((full_build / "smoke").rglob("checkpoints"))
    assert not (full_build / "smoke" / "averaged").exists()


def test_the_evaluation_section_shows_the_mtp_acceptance_per_draft_position(
    tmp_path: Path,
) -> None:
    """A model with MTP heads: its samples' drafts accepted per position, summed, and the
    new tokens per main-model forward (Super's numbers come from ``factory generate``, whose
    own tests check them)."""
    losses = {"loss": 5.0, "perplexity": 148.4, "sets": {"code": 5.0}}
    sample = {"prompt": "a < b", "text": " & c", "forwards": 4, "new_tokens": 8,
              "drafted": [3, 3], "accepted": [2, 1]}  # fmt: skip
    record = {"stage": None, "sets": ["code"], "speculative": "mtp",
              "checkpoints": [{"step": 8, **losses}],
              "averaged": {"steps": [8], "weights": [1.0], **losses},
              "samples": [sample, {**sample, "accepted": [3, 0]}],
              "acceptance": {"drafted": [6, 6], "accepted": [5, 1], "tokens_per_forward": 2.0}}  # fmt: skip
    (tmp_path / "evaluation.json").write_text(json.dumps(record))
    page = evaluation_section(BuildFolder(tmp_path))
    text = _text("<body>" + page)
    assert "2.00 new tokens per main-model forward" in text
    assert re.search(r"1\s+5\s+6\s+83.3%", text) and re.search(r"2\s+1\s+6\s+16.7%", text)
    assert "a &lt; b" in page and "&amp; c" in page


def test_the_page_fetches_nothing_and_links_every_artifact(full_build: Path) -> None:
    page = _page(full_build)
    assert not re.search(r"(src|href)=\"(https?:)?//", page)
    assert "url(" not in page and "@import" not in page
    for path in full_build.rglob("*"):
        if path.is_file() and path.name != "report.html":
            relative = path.relative_to(full_build).as_posix()
            assert f'href="{relative}"' in page, relative


def test_precision_strip_colours_each_layer_by_its_gemms_formats(tmp_path: Path) -> None:
    """Super's first layer mixes NVFP4 and MXFP8 and its MTP is BF16; Ultra is cut into four
    pipeline stages."""
    for name, cuts in (("super", 0), ("ultra", 3)):
        root = tmp_path / name
        summary = _write_plan_pieces(root, factory.load_blueprint(name))
        page = _page(root) if write_build_report(root) else ""
        assert page.count('<line class="cut"') == cuts
        layers = sum(summary["layout"]["layers_per_rank"])
        assert page.count("<title>layer ") == 2 * layers  # the cell and its precision strip
        share = json.loads((root / "precision.json").read_text())["flops_share"]
        for recipe in share:
            assert recipe.upper() in page
    text = _text(_page(tmp_path / "super"))
    assert "mixer.out_proj: mxfp8" in text and "mixer.in_proj: nvfp4" in text
    assert "MTP block 0" in text
    for rank in range(4):
        assert f"PP{rank}" in _text(_page(tmp_path / "ultra"))


def test_skipped_and_failed_stages_render_notes_not_errors(tmp_path: Path) -> None:
    root = tmp_path / "bare"
    _stages(root, "bare", {"plan": "failed", "precision": "skipped", "data": "skipped",
                           "smoke": "skipped", "distributed": "skipped", "export": "skipped",
                           "model": "skipped"})  # fmt: skip
    page = _page(root) if write_build_report(root) else ""
    assert "No plan.json: the plan stage failed: plan result 1." in page
    assert "No data manifest: the data stage skipped: data result 5." in page
    assert "No distributed check: the distributed stage skipped" in page
    assert "<img" not in page and "<svg" not in page
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "No build.json" in _page(empty) if write_build_report(empty) else False


def test_a_failed_distributed_check_says_fail(full_build: Path, tmp_path: Path) -> None:
    root = tmp_path / "copy"
    root.mkdir()
    smoke = json.loads((full_build / "distributed.json").read_text())["smoke_losses"]
    check = _distributed(root, smoke, 1e-2)
    page = _page(root) if write_build_report(root) else ""
    assert not check["passed"] and "FAIL" in page and "PASS" not in page


def test_report_is_written_atomically_and_imports_no_torch(tmp_path: Path) -> None:
    import subprocess

    code = "import factory.report.build_page, sys; assert 'torch' not in sys.modules, 'torch'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    root = tmp_path / "b"
    root.mkdir()
    target = write_build_report(root)
    assert target == root / "report.html" and [p.name for p in root.iterdir()] == ["report.html"]


def test_a_finished_build_keeps_what_a_rerun_needs_and_no_checkpoints(full_build: Path) -> None:
    """The training stages' checkpoints only resume them; a finished build drops them (and
    the layout check's model), keeping the smoke run's model, metrics and report."""
    assert not list(full_build.rglob("checkpoints"))
    assert not (full_build / "distributed" / "model").exists()
    for kept in ("model/model.safetensors", "metrics.jsonl", "report/report.html"):
        assert (full_build / "smoke" / kept).is_file(), kept
    result = factory.build(one_stage("nano"), out=full_build, steps=4, check_steps=1)
    assert {r.status for r in result.stages} == {"reused", "done"}  # only the page is redone
    assert result.size == sum(p.stat().st_size for p in full_build.rglob("*") if p.is_file())


def _stage_row(page: str, stage: str) -> list[str]:
    """The cells of the stages table's row for ``stage``, tags stripped."""
    row = re.search(rf"<tr><td>{stage}</td>(.*?)</tr>", page.split("class='stages'", 1)[1])
    assert row, stage
    return [re.sub(r"<[^>]+>", "", cell) for cell in re.findall(r"<td[^>]*>(.*?)</td>", row[1])]


def test_the_report_stage_is_this_page_done_not_not_run(tmp_path: Path) -> None:
    """The build draws the page before it records the report stage: the page is that stage."""
    root = tmp_path / "b"
    build = _stages(root, "b", {})
    del build["stages"]["report"]
    _write_json(root / "build.json", build)
    page = _page(root) if write_build_report(root) else ""
    assert _stage_row(page, "report") == ["done", "—", "this page"]
    assert _stage_row(page, "smoke") == ["done", "6.5", "smoke result 6"]
    _stages(root, "b", {"report": "skipped"})  # --skip report, drawn later: as recorded
    page = _page(root) if write_build_report(root) else ""
    assert _stage_row(page, "report")[0] == "skipped"


def test_the_cost_section_is_the_plans_tables_with_units(tmp_path: Path) -> None:
    """The terminal's cost, failure and interval tables, formatted by the same code: no dotted
    keys, no exponent, whole steps and checkpoints."""
    root = tmp_path / "nano"
    summary = _write_plan_pieces(root, factory.load_blueprint("nano"))
    page = _page(root) if write_build_report(root) else ""
    section = page.split('<section id="cost">', 1)[1].split("</section>", 1)[0]
    cost = re.sub(r"<[^>]+>", " ", section)
    for part in cost_tables(summary):
        assert part.title in cost
        for row in part.rows:
            assert all(html.escape(cell, quote=False) in cost for cell in row), row
    assert "sync.optimal" not in cost and "lost_fraction" not in cost
    assert not re.search(r"\d[eE][+-]?\d", cost)
    assert not re.search(r"\d\.\d+ (steps|checkpoints)", cost)
    assert "synchronous" in cost and "asynchronous" in cost and "GPU-hours" in cost


def test_the_predicted_step_is_drawn_part_by_part(tmp_path: Path) -> None:
    root = tmp_path / "nano"
    summary = _write_plan_pieces(root, factory.load_blueprint("nano"))
    page = _page(root) if write_build_report(root) else ""
    assert '<section id="speed">' in page
    perf = summary["performance"]
    text = _text(page)
    assert f"{perf['tokens_per_s_per_gpu']:,.0f}" in text
    parts = [v for group in perf["breakdown_seconds"].values()
             for v in (group.values() if isinstance(group, dict) else [group]) if v > 0]  # fmt: skip
    assert page.count('<svg xmlns="http://www.w3.org/2000/svg" class="step"') == 1
    assert text.count(" s (") >= len(parts)  # every part's hover title: seconds (share)


def test_the_searchs_fastest_layouts_are_listed_with_the_best_overrides(full_build: Path) -> None:
    """The plan stage searches the blueprint's GPUs; the page lists what it found, fastest
    first, and the overrides that turn the blueprint into the best."""
    found = json.loads((full_build / "search.json").read_text())
    layouts = found["layouts"]
    assert found["gpus"] == factory.load_blueprint("nano").parallelism.world_size
    speeds = [entry["performance"]["tokens_per_s_per_gpu"] for entry in layouts]
    assert layouts and speeds == sorted(speeds, reverse=True)
    section = _page(full_build).split('<section id="speed">', 1)[1].split("</section>", 1)[0]
    rows = re.findall(r"<tr><td>(\d+)</td><td>([^<]*)</td><td>([^<]*)</td>", section)
    assert [(int(n), layout) for n, layout, _ in rows] == [
        (i, entry["layout"]) for i, entry in enumerate(layouts, 1)
    ]
    assert [speed for _, _, speed in rows] == [f"{s:,.0f}" for s in speeds]
    for override in layouts[0]["overrides"]:
        assert f"--set {override}" in html.unescape(section)


def test_the_step_bar_colours_a_layer_types_time_as_the_layer_stack_does() -> None:
    """Compute of a layer type in the stack's colour for that type, its recompute paler, and
    communication in none of the types' colours."""
    from factory.report.layer_stack import type_colour
    from factory.report.step_bar import part_colour
    from factory.spec.layer_type import LAYER_TYPES

    names = [kind.name for kind in LAYER_TYPES.values()]
    type_colours = {type_colour(name) for name in names}
    for name in names:
        assert part_colour(f"compute.{name}") == (type_colour(name), 1.0)
        colour, opacity = part_colour(f"recompute.{name}")
        assert colour == type_colour(name) and opacity < 1
    for kind in ("tp", "ep", "cp", "pp", "dp"):
        assert part_colour(f"communication.{kind}")[0] not in type_colours
