"""The build page's sections about the build itself: stages, the model check, precision,
exports, files."""

from __future__ import annotations

import os
from pathlib import Path

from factory.report.build_folder import STAGES, BuildFolder, StageInfo, missing
from factory.report.html_parts import escape, key_value_table, note, section, table
from factory.report.layer_stack import precision_colour
from factory.report.units import human_bytes, human_count, percent

__all__ = [
    "artifacts_section", "exports_section", "model_section", "precision_section",
    "stages_section",
]  # fmt: skip

EXPORTS = {"exports/hf": "Hugging Face", "exports/megatron": "Megatron-Bridge"}
FOLDED = 12
"""A folder with more files than this is listed folded (shards, checkpoints)."""


def _stage(folder: BuildFolder, name: str) -> StageInfo:
    """The stage as build.json records it; the report stage writes this page before the build
    records it, so unrecorded, it is this page, done."""
    info = folder.stage(name)
    if name == "report" and info.status == "not run":
        return StageInfo("done", None, "this page")
    return info


def stages_section(folder: BuildFolder) -> str:
    rows = []
    for name in STAGES:
        info = _stage(folder, name)
        seconds = f"{info.seconds:,.1f}" if info.seconds is not None else "—"
        css = escape(info.status.replace(" ", "-"))
        rows.append(
            f"<tr><td>{escape(name)}</td><td class='status {css}'>{escape(info.status)}</td>"
            f"<td class='num'>{seconds}</td><td>{escape(info.result)}</td></tr>"
        )
    total = sum(folder.stage(s).seconds or 0.0 for s in STAGES)
    head = "<thead><tr><th>stage</th><th>status</th><th>seconds</th><th>result</th></tr></thead>"
    body = f"<table class='stages'>{head}<tbody>{''.join(rows)}</tbody></table>"
    if not folder.build:
        body = note("No build.json: the build did not record its stages.", "warn") + body
    return section("stages", "Stages", body + f"<p>{total:,.1f} s in all.</p>")


def model_section(folder: BuildFolder) -> str:
    check = folder.model_check
    if check is None:
        return section("model", "Model graph", missing(folder, "model", "model check"))
    built, planned = int(check["parameters"]), int(check["plan_parameters"])
    verdict = (
        "matches the plan" if built == planned else f"differs from the plan by {built - planned:+,}"
    )
    facts = [
        ("built on device", str(check.get("device", "?"))),
        ("tensors", f"{int(check['tensors']):,}"),
        ("parameters", f"{built:,} ({human_count(built)}), {verdict}"),
        ("plan's parameters", f"{planned:,}"),
    ]
    return section("model", "Model graph", key_value_table(facts))


def precision_section(folder: BuildFolder) -> str:
    precision = folder.precision
    if precision is None:
        return section("precision", "Precision", missing(folder, "precision", "precision policy"))
    modules = precision["modules"]
    shares = precision.get("flops_share") or {}
    rows = []
    for recipe, share in sorted(shares.items(), key=lambda kv: -kv[1]):
        count = sum(1 for m in modules if m["recipe"] == recipe)
        swatch = f"<span style='color:{precision_colour(recipe)}'>■</span>"
        rows.append(
            f"<tr><td>{swatch} {escape(recipe)}</td><td class='num'>{count:,}</td>"
            f"<td class='num'>{escape(percent(share))}</td></tr>"
        )
    reasons: dict[str, int] = {}
    for m in modules:
        reasons[m["reason"]] = reasons.get(m["reason"], 0) + 1
    head = "<thead><tr><th>format</th><th>GEMMs</th><th>share of linear FLOPs</th></tr></thead>"
    body = f"<table>{head}<tbody>{''.join(rows)}</tbody></table>"
    reason_rows = [[r, f"{n:,}"] for r, n in sorted(reasons.items(), key=lambda kv: -kv[1])]
    body += "<h3>Why each GEMM has its format</h3>" + table(
        ["rule", "GEMMs"], reason_rows, "numbers"
    )
    return section("precision", "Precision", body)


def _link(folder: BuildFolder, relative: Path, text: str | None = None) -> str:
    href = escape(relative.as_posix())
    return f'<a href="{href}">{escape(text or relative.as_posix())}</a>'


def exports_section(folder: BuildFolder) -> str:
    parts = []
    for where, title in EXPORTS.items():
        files = [
            p for p in folder.files() if p.parts[: len(Path(where).parts)] == Path(where).parts
        ]
        if files:
            links = ", ".join(_link(folder, p, p.relative_to(where).as_posix()) for p in files)
            parts.append(f"<p><b>{escape(title)}</b> ({escape(where)}/): {links}</p>")
        else:
            parts.append(
                f"<p><b>{escape(title)}</b>: </p>" + missing(folder, "export", f"{where}/")
            )
    return section("exports", "Exports", "".join(parts))


def _file_item(folder: BuildFolder, relative: Path) -> str:
    size = human_bytes(os.path.getsize(folder.path(relative.as_posix())))
    return f"<li>{_link(folder, relative)} <small>{escape(size)}</small></li>"


def _group(relative: Path) -> str:
    return relative.parts[0] if len(relative.parts) > 1 else "."


def artifacts_section(folder: BuildFolder) -> str:
    """Every file of the build, linked relative to the page, folder by folder."""
    groups: dict[str, list[Path]] = {}
    for relative in folder.files():
        groups.setdefault(_group(relative), []).append(relative)
    if not groups:
        return section("artifacts", "Artifacts", note("The folder holds no other file."))
    parts = []
    for name, files in sorted(groups.items(), key=lambda kv: (kv[0] != ".", kv[0])):
        items = "".join(_file_item(folder, p) for p in files)
        size = human_bytes(sum(os.path.getsize(folder.path(p.as_posix())) for p in files))
        title = "top level" if name == "." else f"{name}/"
        opened = "" if len(files) > FOLDED else " open"
        parts.append(
            f"<details{opened}><summary><b>{escape(title)}</b> — {len(files):,} files, "
            f"{escape(size)}</summary><ul class='files'>{items}</ul></details>"
        )
    return section("artifacts", "Artifacts", "".join(parts))
