"""The build page's sections about what the build ran: the curated data, the smoke run, the
distributed check."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from factory.report.bar_chart import Series, bar_chart_svg
from factory.report.build_folder import BuildFolder, missing
from factory.report.html_parts import (
    escape,
    figure_png,
    figure_svg,
    key_value_table,
    note,
    section,
    table,
)
from factory.report.run_metrics import ReportError, read_metrics
from factory.report.run_plots import CAPTIONS, COLUMN_WIDTH, distributed_loss_png, plots
from factory.report.units import format_number, human_count, percent

__all__ = ["data_section", "run_section"]

SMOKE_PLOTS = ("loss.png", "max_vio.png", "residual_rms.png")
"""The run page's plots this page shows: the loss and the two per-layer monitors."""
PLANNED, CURATED, DROPPED = "#9ecae1", "#08519c", "#d62728"


def _planned_tokens(manifest: dict[str, Any]) -> Counter[str]:
    planned: Counter[str] = Counter()
    for source in manifest["sources"].values():
        planned[source["category"]] += int(source.get("mix", {}).get("target_tokens", 0))
    return planned


def _dropped(manifest: dict[str, Any]) -> Counter[str]:
    dropped: Counter[str] = Counter()
    for source in manifest["sources"].values():
        dropped.update({k: int(v) for k, v in (source.get("dropped") or {}).items()})
        dropped.update(
            {f"quarantined: {k}": int(v) for k, v in (source.get("quarantined") or {}).items()}
        )
    return dropped


def _mixture_svg(manifest: dict[str, Any]) -> str:
    planned = _planned_tokens(manifest)
    curated = {c: int(v["tokens"]) for c, v in manifest["categories"].items()}
    names = sorted(set(planned) | set(curated), key=lambda c: -max(planned[c], curated.get(c, 0)))
    series = [
        Series("planned (target tokens of the mix)", PLANNED, [planned[c] for c in names]),
        Series(
            "curated (tokens in the shards' documents)", CURATED, [curated.get(c, 0) for c in names]
        ),
    ]
    return bar_chart_svg(names, series, lambda v: f"{human_count(v)} tokens")


def _mixture_rows(manifest: dict[str, Any]) -> str:
    planned = _planned_tokens(manifest)
    curated = {c: int(v["tokens"]) for c, v in manifest["categories"].items()}
    docs = {c: int(v["documents"]) for c, v in manifest["categories"].items()}
    p_total, c_total = sum(planned.values()) or 1, sum(curated.values()) or 1
    rows = "".join(
        f"<tr><td>{escape(c)}</td><td class='num'>{planned[c]:,}</td>"
        f"<td class='num'>{percent(planned[c] / p_total)}</td><td class='num'>{curated.get(c, 0):,}</td>"
        f"<td class='num'>{percent(curated.get(c, 0) / c_total)}</td><td class='num'>{docs.get(c, 0):,}</td></tr>"
        for c in sorted(set(planned) | set(curated))
    )
    head = ("<thead><tr><th>category</th><th>planned tokens</th><th>planned share</th>"
            "<th>curated tokens</th><th>curated share</th><th>documents</th></tr></thead>")  # fmt: skip
    return f"<table>{head}<tbody>{rows}</tbody></table>"


def data_section(folder: BuildFolder) -> str:
    if folder.program:
        return section("data", "Data mixture", _program_data(folder))
    manifest = folder.manifest
    if manifest is None:
        return section("data", "Data mixture", missing(folder, "data", "data manifest"))
    return section("data", "Data mixture", _manifest_html(manifest))


def _program_data(folder: BuildFolder) -> str:
    """Each program stage's curation in tables, folded but the first (the program section
    draws every stage's mixture); a stage sharing another's curation says so."""
    records = folder.program_records("data")
    parts = []
    for i, name in enumerate(folder.stage_names()):
        record = records.get(name) or {}
        manifest = folder.stage_manifest(name)
        if manifest is None:
            parts.append(f"<h3>{escape(name)}</h3>" + missing(folder, "data", f"data/{name}/"))
            continue
        shared = record.get("shared_with")
        also = f"; the same curation as {escape(shared)} (hard-linked)" if shared else ""
        title = (
            f"<b>{escape(name)}</b>: recipe {escape(record.get('recipe', '?'))} at "
            f"{escape(record.get('seq_len', '?'))} tokens{also}"
        )
        opened = " open" if i == 0 else ""
        parts.append(
            f"<details{opened}><summary>{title}</summary>{_manifest_html(manifest, False)}"
            "</details>"
        )
    return "".join(parts) or missing(folder, "data", "data manifests")


def _manifest_html(manifest: dict[str, Any], pictures: bool = True) -> str:
    """One curation's mixture, dropped documents and packing; without ``pictures`` as tables
    alone (a program's stages, folded: the program section draws their mixtures)."""
    parts = [
        figure_svg(
            _mixture_svg(manifest),
            "Tokens per category: what the recipe's mix "
            "planned against what curation delivered after filtering, dedup, "
            "decontamination and up- or down-sampling.",
        )
        if pictures
        else "",
        _mixture_rows(manifest),
    ]
    dropped = _dropped(manifest)
    parts.append("<h3>Documents dropped, by reason</h3>")
    if dropped and not pictures:
        rows = [[reason, f"{count:,}"] for reason, count in dropped.most_common()]
        parts.append(table(["reason", "documents"], rows, "numbers"))
    elif dropped:
        reasons = [r for r, _ in dropped.most_common()]
        svg = bar_chart_svg(reasons, [Series("documents", DROPPED, [dropped[r] for r in reasons])],
                            lambda v: f"{v:,.0f}")  # fmt: skip
        parts.append(
            figure_svg(
                svg, f"{sum(dropped.values()):,} documents dropped in all, summed over the sources."
            )
        )
    else:
        parts.append(note("No document was dropped.", "info"))
    packing = manifest.get("packing") or {}
    facts = [
        (k.replace("docs_", "documents_").replace("_", " "), format_number(v))
        for k, v in packing.items()
        if isinstance(v, int | float)
    ]
    facts.append(("shards", f"{len(manifest.get('shards') or []):,}"))
    parts.append("<h3>Packing</h3>" + key_value_table(facts))
    return "".join(parts)


def _smoke_plots(run_dir: Path) -> tuple[list[tuple[str, bytes, str]], str | None]:
    """(file, PNG, caption) of the run's loss and monitor plots, and the reason when there are
    none (no metrics, or no step yet)."""
    try:
        metrics = read_metrics(run_dir)
    except ReportError as exc:
        return [], str(exc)
    if not metrics.steps:
        return [], f"{metrics.path}: no step recorded"
    drawn = [
        (f, png, CAPTIONS[f]) for f, png in plots(metrics, width=COLUMN_WIDTH) if f in SMOKE_PLOTS
    ]
    return drawn, None


def _distributed_html(folder: BuildFolder) -> str:
    check = folder.distributed
    if check is None:
        return "<h3>Distributed check</h3>" + missing(folder, "distributed", "distributed check")
    passed = bool(check.get("passed"))
    verdict = "<span class='pass'>PASS</span>" if passed else "<span class='fail'>FAIL</span>"
    layout = ", ".join(f"{k}={v}" for k, v in (check.get("layout") or {}).items())
    difference = float(check["max_relative_difference"])
    against = f"one process on stage {check['stage']}" if check.get("stage") else "the smoke run"
    title = f"{check.get('world_size', '?')} processes ({layout}) against {against}"
    png = distributed_loss_png(
        check["steps"],
        check["losses"],
        check["smoke_losses"],
        float(check["tolerance"]),
        f"distributed vs {'one process' if check.get('stage') else 'smoke'} loss",
        f"stage {check['stage']}, 1 process" if check.get("stage") else "smoke (1 process)",
    )
    facts = key_value_table([
        ("processes", str(check.get("world_size", "?"))),
        ("layout", layout or "—"),
        ("steps compared", f"{len(check['steps'])}"),
        ("max relative difference", f"{difference:.3e}"),
        ("tolerance", f"{float(check['tolerance']):.3e}"),
    ])  # fmt: skip
    return (
        f"<h3>Distributed check: {verdict}</h3>"
        + figure_png(
            png, "distributed loss", title + ": losses overlaid, and their relative difference."
        )
        + facts
    )


def _program_runs(folder: BuildFolder) -> str:
    """A program's smoke run: its loss is on the program's timeline; here each stage's run
    page, beside the distributed check."""
    items = []
    for name in folder.stage_names():
        page = f"smoke/{name}/report/report.html"
        if folder.exists(page):
            items.append(f'<li>{escape(name)}: <a href="{escape(page)}">{escape(page)}</a></li>')
    left = "<h3>Smoke run</h3>"
    if not folder.path("smoke").is_dir():
        left += missing(folder, "smoke", "smoke run")
    else:
        left += (
            '<p>The loss of every stage is on the <a href="#program">program\'s timeline</a>. '
            "Every plot and event of each stage's run:</p>"
            + (
                f"<ul>{''.join(items)}</ul>"
                if items
                else note("No stage wrote its run page.", "warn")
            )
        )
    body = f"<div class='columns'><div>{left}</div><div>{_distributed_html(folder)}</div></div>"
    return section("runs", "Smoke run and distributed check", body)


def _kernels_html(summary: Any) -> str:
    """The smoke run's kernel report (``train.json``'s ``kernels``: what its first lines
    said), or nothing for a run that recorded none."""
    lines = summary.get("kernels") if isinstance(summary, dict) else None
    if not lines:
        return ""
    items = "".join(f"<li>{escape(str(line).removeprefix('kernels: '))}</li>" for line in lines)
    return f"<h3>Smoke run: kernels</h3><ul>{items}</ul>"


def run_section(folder: BuildFolder) -> str:
    """The smoke run's loss beside the distributed check, then the run's monitors."""
    if folder.program:
        return _program_runs(folder)
    run_dir = folder.path("smoke")
    drawn, why = _smoke_plots(run_dir) if run_dir.is_dir() else ([], None)
    if drawn:
        loss = [figure_png(png, f, caption) for f, png, caption in drawn if f == "loss.png"]
        left = "<h3>Smoke run: loss</h3>" + "".join(loss)
    else:
        left = "<h3>Smoke run</h3>" + (
            note(f"No plots: {why}", "warn") if why else missing(folder, "smoke", "smoke run")
        )
    left += _kernels_html(folder.read_json("smoke/train.json"))
    if folder.exists("smoke/report/report.html"):
        left += '<p>Every plot and event of the run: <a href="smoke/report/report.html">smoke/report/report.html</a>.</p>'
    body = f"<div class='columns'><div>{left}</div><div>{_distributed_html(folder)}</div></div>"
    monitors = [figure_png(png, f, caption) for f, png, caption in drawn if f != "loss.png"]
    if monitors:
        cells = "".join(f"<div>{m}</div>" for m in monitors)
        body += f"<h3>Smoke run: monitors</h3><div class='columns'>{cells}</div>"
    elif drawn:
        body += note("The run logged no per-layer monitor (MaxVio or residual RMS).", "warn")
    return section("runs", "Smoke run and distributed check", body)
