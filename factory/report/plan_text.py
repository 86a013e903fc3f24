"""A plan as text: its tables (every number exact and readable), rich tables for the terminal
(``factory plan``), and Markdown for ``report.md``; the build page shows the same tables."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from rich import box
from rich.table import Table
from rich.text import Text

from factory.report.units import (
    format_number,
    human_bytes,
    human_count,
    human_duration,
    human_energy,
    human_flops,
    human_gpu_hours,
    percent,
    plain,
)

__all__ = [
    "PROGRAM_COLUMNS",
    "PlanTable",
    "cost_summary",
    "cost_tables",
    "curated_line",
    "flatten",
    "markdown_report",
    "model_tables",
    "performance_tables",
    "plan_tables",
    "program_layouts",
    "program_rows",
    "program_summary",
    "program_table",
    "rich_tables",
]  # fmt: skip


def flatten(data: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """Leaf values of nested dicts as (dotted.key, value)."""
    for key, value in data.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, dict):
            yield from flatten(value, name)
        else:
            yield name, value


@dataclass(frozen=True)
class PlanTable:
    """One table of a plan: rows of (what, value, note), or of (what, one column per header)."""

    title: str
    rows: list[tuple[str, str, str]]
    header: tuple[str, str, str] | None = None
    """Column names where the columns are alike (synchronous, asynchronous); None: a value and
    a note."""


FLOPS_LABELS = {
    "megatron": "Megatron's formula",
    "exact": "exact count",
    "exact_forward": "exact count, forward only",
    "by_layer_type": "exact",
    "megatron_by_layer_type": "Megatron's formula",
}
"""Words for the keys of ``FlopsPerToken.to_dict()``."""


def _flops_label(key: str) -> str:
    """'by_layer_type.moe' -> 'moe layers, exact'; a key it does not know, as it is."""
    group, _, layer_type = key.partition(".")
    if layer_type:
        what = "LM head" if layer_type == "head" else f"{layer_type} layers"
        return f"{what}, {FLOPS_LABELS.get(group, group)}"
    return FLOPS_LABELS.get(key, key)


def plan_tables(plan: dict[str, Any], cpu_proxy: bool = False) -> list[PlanTable]:
    """Every part of the plan as a table. A CPU proxy's cost and failure figures would price
    GPUs it never uses, so its plan says they do not apply instead."""
    if cpu_proxy:
        return [*model_tables(plan), PlanTable("Speed, cost and failures", NOT_APPLICABLE)]
    return [*model_tables(plan), *performance_tables(plan), *cost_tables(plan)]


def model_tables(plan: dict[str, Any]) -> list[PlanTable]:
    """The model and its training: parameters, FLOPs, memory, layout, steps."""
    params = plan["params"]
    param_rows = [
        ("total (with MTP)", f"{params['total']:,}", human_count(params["total"])),
        ("total, main model", f"{params['total_main']:,}", human_count(params["total_main"])),
        ("active per token", f"{params['active']:,}", human_count(params["active"])),
    ]
    for layer_type, row in params["by_layer_type"].items():
        param_rows.append(
            (
                f"{layer_type} x{row['layers']}",
                f"{row['total']:,}",
                f"{human_count(row['per_layer'])} per layer",
            )
        )
    flops = plan["flops_per_token"]
    flop_rows = [
        (_flops_label(key), f"{round(value):,}", human_flops(value))
        for key, value in flatten(flops)
        if isinstance(value, (int, float)) and value and key != "seq_len"
    ]
    flop_rows.insert(0, ("sequence length", f"{flops['seq_len']:,}", "tokens"))
    memory = plan["memory_per_rank_bytes"]
    activations = memory["activations"]
    memory_rows = [
        (label, f"{value:,}", human_bytes(value))
        for label, value in (
            ("weights", memory["weights"]),
            ("gradients", memory["gradients"]),
            ("optimizer (distributed)", memory["optimizer"]["distributed_optimizer"]),
            ("optimizer (replicated)", memory["optimizer"]["no_distributed_optimizer"]),
            *(
                (f"activations, one {kind} layer", size)
                for kind, size in activations["per_layer_type"].items()
            ),
            (
                f"activations ({activations['in_flight_microbatches']:g} micro-batches in flight)",
                activations["total"],
            ),
            (
                "total" + (" (distributed optimizer)" if memory["distributed_optimizer"] else ""),
                memory["total"],
            ),
        )
    ]
    runtime = plan["runtime_state_per_rank_bytes"]
    peak_state = runtime["by_pipeline_rank"][runtime["peak_rank"]]
    runtime_rows = [
        (label, f"{peak_state[key]:,}", human_bytes(peak_state[key]))
        for label, key in (
            ("weights (fp32, the optimizer's masters)", "weights"),
            ("gradients (fp32)", "gradients"),
            ("Adam moments (fp32)", "optimizer"),
            ("total", "total"),
        )
    ]
    layout = plan["layout"]
    layout_rows = [
        (key, str(layout[key]), "")
        for key in (
            "world_size",
            "tp",
            "cp",
            "dp",
            "pp",
            "vpp",
            "ep",
            "etp",
            "edp",
            "sequence_parallel",
            "micro_batch_size",
            "global_batch_size",
            "num_microbatches",
            "layers_per_rank",
        )
        if key in layout
    ]
    training = plan["training"]
    tokens = training["tokens_per_step"] * training["steps"]
    training_rows = [
        (
            "tokens per step",
            f"{training['tokens_per_step']:,}",
            human_count(training["tokens_per_step"]),
        ),
        ("steps", f"{training['steps']:,}", ""),
        ("training tokens", f"{tokens:,}", human_count(tokens)),
        ("total training FLOPs", human_flops(training["total_flops"]), "exact count"),
    ]
    return [
        PlanTable("Parameters", param_rows),
        PlanTable("Training FLOPs per token (fwd+bwd)", flop_rows),
        PlanTable(f"Memory of the peak rank (pipeline rank {memory['peak_rank']})", memory_rows),
        PlanTable(
            f"Model state per rank in factory's runtime (pipeline rank {runtime['peak_rank']})",
            runtime_rows,
        ),
        PlanTable("Layout", layout_rows),
        PlanTable("Training", training_rows),
    ]


NOT_APPLICABLE = [
    (
        "not applicable",
        "the proxy trains on CPU",
        "GPU-hours, energy and failure rates price GPUs; plan without --proxy for the full model",
    )
]


def cost_tables(plan: dict[str, Any]) -> list[PlanTable]:
    """The cost, the failures and the checkpoint intervals: the terminal's tables and the build
    page's cost section."""
    cost, failures = plan["cost"], plan["failures"]
    return [
        PlanTable(_cost_title(cost), _cost_rows(cost, plan["training"]["steps"])),
        PlanTable("Failures and checkpoints", _failure_rows(failures)),
        PlanTable(
            "Checkpoint intervals",
            _interval_rows(failures, plan["training"]["steps"]),
            ("", "synchronous", "asynchronous"),
        ),
    ]


def _mfu(cost: dict[str, Any]) -> str:
    """The MFU in percent: as the blueprint writes it (38%, 38.5%), or as predicted (17.2%)."""
    if cost["basis"] == "predicted":
        return percent(cost["mfu"])
    return f"{plain(cost['mfu'] * 100)}%"


def _cost_title(cost: dict[str, Any]) -> str:
    if cost["basis"] == "predicted":
        return f"Cost at the predicted speed ({_mfu(cost)} MFU)"
    return f"Cost at {_mfu(cost)} MFU (training.cluster.mfu)"


def _cost_rows(cost: dict[str, Any], steps: int) -> list[tuple[str, str, str]]:
    peak = human_flops(cost["peak_flops_per_gpu"]).replace("FLOP", "FLOP/s")
    return [
        ("GPUs", f"{cost['world_size']:,} x {cost['gpu']}", f"peak {peak} dense BF16 each"),
        ("MFU", _mfu(cost), _MFU_BASIS[cost["basis"]]),
        ("wall-clock", human_duration(cost["wall_seconds"]), f"{steps:,} steps"),
        ("time per step", human_duration(cost["step_seconds"]), ""),
        ("GPU time", human_gpu_hours(cost["gpu_hours"]), ""),
        (
            "energy at TDP",
            human_energy(cost["energy_mwh"]),
            f"{cost['tdp_watts']:,.0f} W per GPU, boards only",
        ),
    ]


_MFU_BASIS = {
    "predicted": "predicted (docs/performance.md), of the BF16 peak",
    "training.cluster.mfu": "training.cluster.mfu",
}


def _failure_rows(failures: dict[str, Any]) -> list[tuple[str, str, str]]:
    size, rate = failures["checkpoint_bytes"], failures["failures_per_gpu_hour"]
    mtbf_hours = failures["job_mtbf_hours"]
    return [
        ("interruptions", f"{plain(rate)} per GPU-hour", f"one in {format_number(1 / rate)} GPU-hours"),
        ("job MTBF", human_duration(mtbf_hours * 3600), f"{format_number(mtbf_hours)} h"),
        ("expected interruptions", format_number(failures["expected_interruptions"]), "over the run"),
        ("restart per interruption", human_duration(failures["restart_seconds"]), ""),
        (
            "checkpoint size",
            human_bytes(size),
            f"{failures['checkpoint_bytes_per_param']} B per parameter",
        ),
        ("checkpoint write", human_duration(failures["write_seconds"]), "blocks a sync save"),
        ("copy to host", human_duration(failures["host_copy_seconds"]), "blocks an async save"),
    ]  # fmt: skip


def _interval(policy: dict[str, Any], steps: int) -> str:
    every = policy["interval_steps"]
    whole = " (the whole run)" if every >= steps else ""
    return f"{every:,} steps, {human_duration(policy['interval_seconds'])}{whole}"


def _lost(policy: dict[str, Any]) -> str:
    return f"{percent(policy['lost_fraction'])}, {human_gpu_hours(policy['lost_gpu_hours'])}"


def _interval_rows(failures: dict[str, Any], steps: int) -> list[tuple[str, str, str]]:
    """Synchronous and asynchronous side by side: what a save blocks, the best interval in
    whole steps and what it loses, and the same at the blueprint's interval."""
    sync, async_ = failures["sync"], failures["async"]
    every = sync["blueprint"]["interval_steps"]

    def row(label: str, show: Any) -> tuple[str, str, str]:
        return (label, show(sync), show(async_))

    return [
        row("blocked per save", lambda m: human_duration(m["blocking_seconds"])),
        row("not durable for", lambda m: human_duration(m["exposure_seconds"]) if m["exposure_seconds"] else "none"),
        row("Young / Daly interval", lambda m: " / ".join(
            human_duration(m[k]) for k in ("young_interval_seconds", "daly_interval_seconds"))),
        row("best interval", lambda m: _interval(m["optimal"], steps)),
        row("checkpoints at best", lambda m: f"{m['optimal']['checkpoints']:,}"),
        row("lost at best", lambda m: _lost(m["optimal"])),
        row(f"lost every {every:,} steps", lambda m: _lost(m["blueprint"])),
    ]  # fmt: skip


def cost_summary(plan: dict[str, Any], cpu_proxy: bool = False) -> str:
    """One line: what the run costs and what failures take from it."""
    if cpu_proxy:
        return (
            "cost: not applicable, the proxy trains on CPU "
            "(plan without --proxy to price the full model's GPUs)"
        )
    cost, failures = plan["cost"], plan["failures"]
    best = failures["async"]["optimal"]
    return (
        f"cost: {human_gpu_hours(cost['gpu_hours'])}, {cost['wall_days']:,.1f} days on "
        f"{cost['world_size']:,} x {cost['gpu']} at {_mfu(cost)} MFU "
        f"({'predicted' if cost['basis'] == 'predicted' else 'training.cluster.mfu'}), "
        f"{human_energy(cost['energy_mwh'])} at TDP (GPU boards only); "
        f"{format_number(failures['expected_interruptions'])} interruptions expected, "
        f"{percent(best['lost_fraction'])} of the run lost with async checkpoints every "
        f"{best['interval_steps']:,} steps"
    )


def _rich_table(part: PlanTable) -> Table:
    """A table for the terminal; cells are Text, never markup."""
    table = Table(title=part.title, title_justify="left", show_header=part.header is not None)
    if part.header is not None:
        for name in part.header:
            table.add_column(
                name, justify="right" if name else "left", style="" if name else "bold"
            )
        for row in part.rows:
            table.add_row(*(Text(cell) for cell in row))
        return table
    table.add_column(style="bold")
    table.add_column(justify="right")
    notes = any(row[2] for row in part.rows)  # no empty column where no row has a note
    if notes:
        table.add_column(style="dim")
    for row in part.rows:
        table.add_row(*(Text(cell) for cell in row[: 3 if notes else 2]))
    return table


def rich_tables(plan: dict[str, Any], cpu_proxy: bool = False) -> list[Table]:
    return [_rich_table(part) for part in plan_tables(plan, cpu_proxy)]


def markdown_report(plan: dict[str, Any], title: str) -> str:
    lines = [f"# {title}", "", cost_summary(plan), ""]
    for part in plan_tables(plan):
        header = part.header or ("", "value", "")
        align = "|---|---:|---:|" if part.header else "|---|---:|---|"
        lines += [f"## {part.title}", "", "| " + " | ".join(header) + " |", align]
        lines += [f"| {a} | {b} | {c} |" for a, b, c in part.rows]
        lines.append("")
    return "\n".join(lines)


def performance_tables(plan: dict[str, Any]) -> list[PlanTable]:
    """The predicted speed and where a step's time goes (none for a plan without one)."""
    perf = plan.get("performance")
    if not perf:
        return []
    step = perf["step_seconds"]
    peak = human_flops(perf["peak_flops_per_gpu"]).replace("FLOP", "FLOP/s")
    rows = [
        ("tokens/s per GPU", f"{perf['tokens_per_s_per_gpu']:,.0f}", f"on {perf['gpu']}"),
        ("step time", human_duration(step), ""),
        ("MFU", percent(perf["mfu"]), f"of {peak} dense {perf['peak_format'].upper()}"),
    ]
    for name, value in flatten(perf["breakdown_seconds"]):
        what = name.replace(".", ": ").replace("_", " ")
        rows.append((what, human_duration(value), f"{percent(value / step)} of the step"))
    return [PlanTable("Predicted speed (docs/performance.md)", rows)]


PROGRAM_COLUMNS = (
    "stage", "seq len", "tokens", "steps", "days", "GPU-hours", "GiB/rank",
)  # fmt: skip
"""The columns of :func:`program_rows`: one stage a row, the totals last. The units are in
the headers so that eight stages' numbers fit 80 characters."""

_PRICED = ("days", "GPU-hours")
"""Columns that price GPUs, which a CPU proxy does not use."""


def _stage_layout(plan: dict[str, Any]) -> str:
    """'256 x h100 tp8 cp8 pp4 ep8 gbs48': what decides a stage's speed and memory (the sizes
    above one)."""
    layout, cost = plan["layout"], plan["cost"]
    split = [f"{key}{layout[key]}" for key in ("tp", "cp", "pp", "ep") if layout.get(key, 1) > 1]
    return " ".join(
        [f"{cost['world_size']} x {cost['gpu']}", *split, f"gbs{layout['global_batch_size']}"]
    )


def _gib(n_bytes: float) -> str:
    return f"{n_bytes / 2**30:,.1f}"


def program_rows(program: dict[str, Any]) -> list[tuple[str, ...]]:
    """A program's plan (``ProgramPlan.to_dict()``) as rows of :data:`PROGRAM_COLUMNS`: each
    stage's numbers, then the totals (the peak memory of the largest stage)."""
    rows: list[tuple[str, ...]] = []
    for stage in program["stages"]:
        plan = stage["plan"]
        cost = plan["cost"]
        rows.append(
            (
                stage["name"],
                f"{stage['seq_len']:,}",
                human_count(stage["tokens"]),
                f"{stage['steps']:,}",
                f"{cost['wall_seconds'] / 86400:,.1f}",
                f"{cost['gpu_hours']:,.0f}",
                _gib(plan["memory_per_rank_bytes"]["total"]),
            )
        )
    totals = program["totals"]
    rows.append(
        (
            "total",
            "",
            human_count(totals["tokens"]),
            f"{totals['steps']:,}",
            f"{totals['wall_seconds'] / 86400:,.1f}",
            f"{totals['gpu_hours']:,.0f}",
            _gib(totals["memory_per_rank_bytes"]),
        )
    )
    return rows


def program_table(program: dict[str, Any], cpu_proxy: bool = False) -> Table:
    """The program's stages and totals for the terminal (the totals' memory is the largest
    stage's). A CPU proxy's days and GPU-hours would price GPUs it never uses, so its table
    leaves them out. No cell wraps: a number split over two lines reads as two numbers."""
    keep = [i for i, c in enumerate(PROGRAM_COLUMNS) if not (cpu_proxy and c in _PRICED)]
    table = Table(
        title=f"Program: {len(program['stages'])} stages",
        title_justify="left",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
        collapse_padding=True,
    )
    for i in keep:
        column = PROGRAM_COLUMNS[i]
        table.add_column(column, justify="left" if i == 0 else "right", no_wrap=True)
    rows = program_rows(program)
    for n, row in enumerate(rows):
        table.add_row(*(Text(row[i]) for i in keep), end_section=n == len(rows) - 2)
    return table


def program_layouts(program: dict[str, Any]) -> Table:
    """Each stage's GPUs, parallel layout and global batch."""
    table = Table(title="Layouts", title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    table.add_column("stage", no_wrap=True)
    table.add_column("layout", overflow="fold")
    for stage in program["stages"]:
        table.add_row(Text(stage["name"]), Text(_stage_layout(stage["plan"])))
    return table


def program_summary(program: dict[str, Any], cpu_proxy: bool = False) -> str:
    """One line: what the whole program trains and costs."""
    totals = program["totals"]
    trained = (
        f"program: {len(program['stages'])} stages, {human_count(totals['tokens'])} tokens in "
        f"{totals['steps']:,} steps"
    )
    if cpu_proxy:
        return f"{trained}; cost: not applicable, the proxy trains on CPU"
    return (
        f"{trained}; {human_gpu_hours(totals['gpu_hours'])}, {totals['wall_days']:,.1f} days "
        f"wall-clock, {human_energy(totals['energy_mwh'])} at TDP (GPU boards only); "
        f"{format_number(totals['expected_interruptions'])} interruptions expected"
    )


def curated_line(curated: dict[str, Any], seq_len: int, stage: str | None = None) -> str:
    """What a stage's steps make of its built data (``StagePlan.curated_dict()``), in epochs."""
    who = f"stage {stage!r}" if stage else "the run"
    line = (
        f"{who}: {format_number(curated['epochs'])} epochs over its curated data "
        f"({curated['samples']:,} samples of {curated['seq_len']:,} tokens, "
        f"{human_count(curated['tokens'])} real tokens)"
    )
    if curated["seq_len"] != seq_len:
        line += f"; packed at {curated['seq_len']:,}, but it trains at {seq_len:,}: rebuild it"
    return line
