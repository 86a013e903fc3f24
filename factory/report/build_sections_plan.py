"""The build page's sections drawn from the plan and the precision policy: layers, memory,
FLOPs, cost."""

from __future__ import annotations

from typing import Any

from factory.report.bar_chart import Series, bar_chart_svg
from factory.report.build_folder import BuildFolder, missing
from factory.report.html_parts import escape, figure_svg, key_value_table, note, section, table
from factory.report.layer_stack import layer_stack_svg
from factory.report.memory_bars import memory_components, memory_svg
from factory.report.plan_text import PlanTable, cost_tables, model_tables
from factory.report.units import human_bytes, human_count, human_flops, percent
from factory.schemas.parallelism import GPU_SPECS

__all__ = ["cost_section", "flops_section", "layers_section", "memory_section"]


def _mtp_pattern(folder: BuildFolder) -> str:
    """The MTP block's pattern from resolved.yaml ('' when the model has none)."""
    model = (folder.resolved or {}).get("model") or {}
    pattern = str(model.get("pattern") or "")
    if "/" in pattern:
        return pattern.split("/", 1)[1].split("/")[0]
    mtp = model.get("mtp") or {}
    return str(mtp.get("pattern") or "") if isinstance(mtp, dict) else ""


def _gpu(folder: BuildFolder) -> str:
    parallelism = (folder.resolved or {}).get("parallelism") or {}
    return str(parallelism.get("gpu") or "h100")


def layers_section(folder: BuildFolder) -> str:
    plan = folder.plan
    if plan is None:
        return section("layers", "Layer stack", missing(folder, "plan", "plan.json"))
    layout = plan["layout"]
    modules = folder.precision["modules"] if folder.precision else None
    svg = layer_stack_svg(layout["stage_patterns"], _mtp_pattern(folder), modules)
    caption = (
        f"{sum(layout['layers_per_rank'])} layers in stack order, one cell each, coloured by type; "
        "the thin strip below each cell is its GEMMs' formats, each as wide as its share of the "
        "layer's FLOPs (hover a cell for every module, its format and why). Black bars are "
        f"pipeline cuts: pp={layout['pp']}, vpp={layout['vpp']} "
        "(PPr·vN: virtual chunk N of pipeline rank r); MTP runs on the last rank."
    )
    body = figure_svg(svg, caption)
    if modules is None:
        body += missing(folder, "precision", "per-module formats (precision.json)")
    parallel = ", ".join(
        f"{k}={layout[k]}"
        for k in ("world_size", "tp", "cp", "dp", "pp", "vpp", "ep", "etp")
        if k in layout
    )
    return section("layers", "Layer stack", f"<p>Layout: {escape(parallel)}.</p>" + body)


def memory_section(folder: BuildFolder) -> str:
    plan = folder.plan
    if plan is None:
        return section("memory", "Memory per rank", missing(folder, "plan", "plan.json"))
    memory = plan["memory_per_rank_bytes"]
    gpu = _gpu(folder)
    capacity = GPU_SPECS[gpu].memory_bytes if gpu in GPU_SPECS else 0
    per_rank = memory.get("per_rank") or [memory]
    svg = memory_svg(per_rank, capacity, gpu)
    optimizer = (
        "distributed optimizer" if memory.get("distributed_optimizer") else "optimizer not sharded"
    )
    caption = (
        f"Bytes per GPU on every pipeline rank, by component ({optimizer}, recompute "
        f"{memory.get('recompute', '?')}); the dashed line is one {gpu.upper()}'s memory."
    )
    rows = [
        [f"PP rank {r.get('pp_rank', 0)}", str(len(r.get("layers", ""))),
         *(human_bytes(v) for v in _components(r)), human_bytes(r["total"])]
        for r in per_rank
    ]  # fmt: skip
    header = ["rank", "layers", "weights", "gradients", "optimizer", "activations", "total"]
    return section(
        "memory", "Memory per rank", figure_svg(svg, caption) + table(header, rows, "numbers")
    )


def _components(rank: dict[str, Any]) -> list[float]:
    return list(memory_components(rank).values())


def flops_section(folder: BuildFolder) -> str:
    plan = folder.plan
    if plan is None:
        return section("flops", "FLOPs per token", missing(folder, "plan", "plan.json"))
    flops = plan["flops_per_token"]
    by_type = {k: float(v) for k, v in flops["by_layer_type"].items() if v}
    total = sum(by_type.values()) or 1.0
    svg = bar_chart_svg(
        list(by_type),
        [Series("training FLOPs per token", "#4c78a8", list(by_type.values()))],
        lambda v: f"{human_flops(v)} ({percent(v / total)})",
    )
    caption = (
        f"Training FLOPs per token (forward and backward) at sequence length {flops['seq_len']:,}, "
        f"by layer type: {human_flops(flops['exact'])} exact, "
        f"{human_flops(flops['megatron'])} by Megatron's formula."
    )
    params = plan["params"]
    facts = [
        ("parameters", f"{human_count(params['total'])} total, {human_count(params['active'])} active"),
        ("training tokens per step", f"{plan['training']['tokens_per_step']:,}"),
        ("training steps", f"{plan['training']['steps']:,}"),
        ("training FLOPs", human_flops(plan["training"]["total_flops"])),
    ]  # fmt: skip
    return section("flops", "FLOPs per token", figure_svg(svg, caption) + key_value_table(facts))


def _plan_table(part: PlanTable) -> str:
    """One of the plan's tables as the terminal prints it: the columns its header names, or a
    value and (where any row has one) a note per row."""
    if part.header is not None:
        return table(list(part.header), [list(row) for row in part.rows], "numbers")
    if any(row[2] for row in part.rows):
        return table(["", "value", "note"], [list(row) for row in part.rows], "plan")
    return table(["", "value"], [list(row[:2]) for row in part.rows], "plan")


def cost_section(folder: BuildFolder) -> str:
    plan = folder.plan
    if plan is None:
        return section("cost", "Cost and failures", missing(folder, "plan", "plan.json"))
    try:
        priced, others = cost_tables(plan), model_tables(plan)
    except (KeyError, TypeError):  # a plan.json of another release
        note_text = "The plan has no cost or failure estimate this page can read."
        return section("cost", "Cost and failures", note(note_text))
    parts = [f"<h3>{escape(part.title)}</h3>" + _plan_table(part) for part in priced]
    tables = "".join(
        f"<details><summary>{escape(part.title)}</summary>{_plan_table(part)}</details>"
        for part in others
    )
    parts.append("<h3>The plan's other tables</h3>" + tables)
    return section("cost", "Cost and failures", "".join(parts))
