"""The build page's program section, for a blueprint with ``stages``: the planned program
and the smoke run on one timeline each, and every stage's data mixture.

The planned program is ``program_plan.json`` (the plan stage's, every number from the
stages' full-size blueprints); the smoke run is ``smoke/<stage>/metrics.jsonl`` with the
verdicts ``build.json`` recorded; the mixtures are ``data/<stage>/manifest.json``. A
single-stage build has no such section.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from factory.report.build_folder import BuildFolder, missing
from factory.report.html_parts import figure_svg, note, section, table
from factory.report.program_timeline import Band, mixture_svg, timeline_svg
from factory.report.run_metrics import ReportError, read_metrics
from factory.report.units import human_bytes, human_count, human_duration, human_gpu_hours

__all__ = ["planned_bands", "program_section", "smoke_bands"]

DEGREES = ("tp", "cp", "ep", "pp")


def _layout_lines(stage: dict[str, Any]) -> tuple[str, str]:
    layout = stage["layout"]
    degrees = " · ".join(f"{k.upper()} {layout[k]}" for k in DEGREES if int(layout.get(k, 1)) > 1)
    return (
        degrees or "no model parallelism",
        f"{int(layout['world_size']):,} GPUs · GBS {int(stage['global_batch_size']):,}",
    )


def _positions(count: int) -> list[float]:
    return [i / (count - 1) if count > 1 else 0.5 for i in range(count)]


def planned_bands(plan: dict[str, Any]) -> list[Band]:
    """The planned program's stages: width by tokens, the LR curve the plan sampled."""
    bands = []
    for stage in plan["stages"]:
        steps = max(1, int(stage["steps"]) - 1)
        schedule = stage["schedule"]
        continued = f", step {schedule['offset']:,} on" if schedule["offset"] else ""
        details = (
            f"{stage['name']}: {stage.get('description') or ''}\n"
            f"recipe {stage['recipe']}, seq len {stage['seq_len']:,}, "
            f"{stage['tokens']:,} tokens in {stage['steps']:,} steps\n"
            f"schedule over {schedule['steps']:,} steps{continued}: {_rates(schedule)}; "
            f"precision {stage['precision']}"
        )
        bands.append(
            Band(
                name=stage["name"],
                amount=float(stage["tokens"]),
                amount_label=f"{human_count(stage['tokens'])} tokens · {stage['steps']:,} steps",
                lr=[(s / steps, rate) for s, rate in stage["lr"]],
                seq_len=int(stage["seq_len"]),
                layout=_layout_lines(stage),
                details=details,
            )
        )
    return bands


def smoke_bands(folder: BuildFolder, names: list[str]) -> tuple[list[Band], list[str]]:
    """The smoke run's stages (width by steps, LR and LM loss per step) and the problems of
    the stages it has no metrics for."""
    plan = {s["name"]: s for s in (folder.program_plan or {}).get("stages", [])}
    data = folder.program_records("data")
    verdicts = folder.program_records("smoke")
    bands, problems = [], []
    for name in names:
        try:
            steps = read_metrics(folder.path(f"smoke/{name}")).steps
        except ReportError as exc:
            problems.append(f"{name}: {exc}")
            continue
        if not steps:
            problems.append(f"{name}: no step recorded")
            continue
        seq_len = (plan.get(name) or {}).get("proxy_seq_len") or (data.get(name) or {}).get(
            "seq_len"
        )
        verdict = verdicts.get(name) or {}
        where = _positions(len(steps))
        bands.append(
            Band(
                name=name,
                amount=float(len(steps)),
                amount_label=f"{len(steps)} steps",
                lr=[(f, r.lr) for f, r in zip(where, steps, strict=True)],
                seq_len=int(seq_len or 0) or 1,
                layout=("1 process", "the CPU proxy"),
                loss=[(f, r.lm_loss) for f, r in zip(where, steps, strict=True)],
                verdict=str(verdict.get("verdict", "")),
                passed=verdict.get("passed") if isinstance(verdict.get("passed"), bool) else None,
                details=f"{name}: {verdict.get('verdict', 'no verdict recorded')}",
            )
        )
    return bands, problems


def _rates(schedule: dict[str, Any]) -> str:
    """``wsd 0.00045 → 4.5e-06``; a constant schedule has one rate (its min_lr is unused)."""
    if schedule["kind"] == "constant":
        return f"constant {schedule['lr']:g}"
    return f"{schedule['kind']} {schedule['lr']:g} → {schedule['min_lr']:g}"


def _plan_table(plan: dict[str, Any]) -> str:
    rows = []
    for stage in plan["stages"]:
        schedule, carry = stage["schedule"], stage["carry"]
        carried = ", ".join(k.replace("_", " ") for k, v in carry.items() if v) or "weights only"
        continued = (
            f" (from step {schedule['offset']:,} of {schedule['steps']:,})"
            if schedule["offset"]
            else ""
        )
        rows.append([
            stage["name"], stage["recipe"], f"{stage['seq_len']:,}",
            f"{stage['global_batch_size']:,}", f"{stage['steps']:,}",
            human_count(stage["tokens"]), " · ".join(_layout_lines(stage)),
            f"{_rates(schedule)}{continued}",
            carried if stage["index"] else "—",
        ])  # fmt: skip
    header = ["stage", "recipe", "seq len", "GBS", "steps", "tokens", "layout", "LR schedule",
              "carries"]  # fmt: skip
    return table(header, rows)


def _predicted_table(plan: dict[str, Any]) -> str:
    """The planner's figures per stage alone, and the program's: time and GPU-hours add up,
    memory per rank is the largest stage's."""
    rows = []
    for stage in plan["stages"]:
        predicted = stage.get("predicted") or {}
        if not predicted:
            return ""
        rows.append([
            stage["name"], f"{predicted['tokens_per_s_per_gpu']:,.0f}",
            human_duration(predicted["wall_seconds"]), human_gpu_hours(predicted["gpu_hours"]),
            human_bytes(predicted["memory_per_rank_bytes"]),
        ])  # fmt: skip
    total = plan.get("predicted") or {}
    if total:
        rows.append(["program", "", human_duration(total["wall_seconds"]),
                     human_gpu_hours(total["gpu_hours"]),
                     f"{human_bytes(total['memory_per_rank_bytes'])} (largest)"])  # fmt: skip
    header = ["stage", "tokens/s per GPU", "time", "GPU-hours", "memory per rank"]
    return "<h4>Predicted, each stage on its own layout</h4>" + table(header, rows, "numbers")


def _planned(folder: BuildFolder) -> str:
    plan = folder.program_plan
    if plan is None:
        return "<h3>Planned program</h3>" + missing(folder, "plan", "planned program")
    bands = planned_bands(plan)
    caption = (
        f"The program as the blueprint plans it: {len(bands)} stages, "
        f"{human_count(plan['tokens'])} tokens in {plan['steps']:,} steps at full size. The "
        "strip on top is to scale in tokens; below, each stage is a band (short stages widened "
        "to stay legible; the axis gives the tokens at each boundary) with its learning rate on "
        "a log scale, where a schedule spanning stages runs on across them, its sequence length "
        "and its layout."
    )
    return (
        "<h3>Planned program</h3>"
        + figure_svg(timeline_svg(bands, "tokens", human_count, "timeline planned"), caption)
        + _plan_table(plan)
        + _predicted_table(plan)
        + "<p>The layer stack, memory, FLOPs, speed and cost sections below plan the "
        "blueprint's own sections, before any stage changes them.</p>"
    )


def _smoke(folder: BuildFolder, names: list[str]) -> str:
    if not folder.path("smoke").is_dir():
        return "<h3>Smoke run</h3>" + missing(folder, "smoke", "smoke run")
    bands, problems = smoke_bands(folder, names)
    parts = ["<h3>Smoke run: the proxy through every stage</h3>"]
    if bands:
        caption = (
            "The CPU proxy trained through every stage, each from the weights the one before "
            "left: its learning rate (log scale) and LM loss per step, and each stage's "
            "sequence length on the proxy. ✓/✗: the stage's verdict (hover it)."
        )
        parts.append(figure_svg(timeline_svg(bands, "steps", lambda v: f"{v:,.0f}",
                                             "timeline smoke"), caption))  # fmt: skip
    verdicts = folder.program_records("smoke")
    rows = [
        [name, str(v.get("steps", "")), "passed" if v.get("passed") else "failed",
         str(v.get("verdict", ""))]
        for name, v in verdicts.items()
    ]  # fmt: skip
    if rows:
        parts.append(table(["stage", "steps", "verdict", "LM loss"], rows))
    for problem in problems:
        parts.append(note(problem, "warn"))
    return "".join(parts)


def _category_tokens(manifest: dict[str, Any]) -> tuple[dict[str, float], dict[str, float]]:
    curated = {c: float(v["tokens"]) for c, v in manifest["categories"].items()}
    planned: Counter[str] = Counter()
    for source in manifest["sources"].values():
        planned[source["category"]] += int(source.get("mix", {}).get("target_tokens", 0))
    return curated, {c: float(v) for c, v in planned.items()}


def _mixtures(folder: BuildFolder, names: list[str]) -> str:
    records = folder.program_records("data")
    rows = []
    for name in names:
        manifest = folder.stage_manifest(name)
        if manifest is None:
            continue
        record = records.get(name) or {}
        shared = f", shared with {record['shared_with']}" if record.get("shared_with") else ""
        caption = f"{record.get('recipe', '?')} at {record.get('seq_len', '?')}{shared}"
        rows.append((name, caption, *_category_tokens(manifest)))
    if not rows:
        return "<h3>Mixture per stage</h3>" + missing(folder, "data", "curated data")
    caption = (
        "Each stage's data by category: the thick bar is the share of tokens curated into the "
        "stage's shards, the thin bar beneath the share its recipe's mix planned."
    )
    return "<h3>Mixture per stage</h3>" + figure_svg(mixture_svg(rows), caption)


def program_section(folder: BuildFolder) -> str:
    if not folder.program:
        return ""
    names = folder.stage_names()
    body = _planned(folder) + _smoke(folder, names) + _mixtures(folder, names)
    return section("program", "Program", body)
