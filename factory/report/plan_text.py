"""A plan as text: its tables (every number exact and readable), rich tables for the terminal
(``factory plan``), and Markdown for ``report.md``; the build page shows the same tables."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from rich.table import Table
from rich.text import Text

from factory.report.units import human_bytes, human_count, human_duration, human_flops

__all__ = [
    "cost_summary",
    "flatten",
    "markdown_report",
    "performance_table",
    "plan_tables",
    "rich_tables",
]


def flatten(data: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """Leaf values of nested dicts as (dotted.key, value)."""
    for key, value in data.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, dict):
            yield from flatten(value, name)
        else:
            yield name, value


def plan_tables(plan: dict[str, Any]) -> list[tuple[str, list[tuple[str, str, str]]]]:
    """(title, rows of (what, exact value, readable value)) for every part of the plan."""
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
        (key, f"{value:,.0f}" if isinstance(value, float) else f"{value:,}", human_flops(value))
        for key, value in flatten(flops)
        if isinstance(value, (int, float)) and value and key != "seq_len"
    ]
    flop_rows.insert(0, ("seq_len", str(flops["seq_len"]), ""))
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
    training_rows = [
        (
            "tokens per step",
            f"{training['tokens_per_step']:,}",
            human_count(training["tokens_per_step"]),
        ),
        ("steps", f"{training['steps']:,}", ""),
        (
            "total training FLOPs",
            f"{training['total_flops']:.3e}",
            human_flops(training["total_flops"]),
        ),
    ]
    return [
        ("Parameters", param_rows),
        ("Training FLOPs per token (fwd+bwd)", flop_rows),
        (f"Memory of the peak rank (pipeline rank {memory['peak_rank']})", memory_rows),
        (
            f"Model state per rank in factory's runtime (pipeline rank {runtime['peak_rank']})",
            runtime_rows,
        ),
        ("Layout", layout_rows),
        *performance_table(plan),
        ("Training", training_rows),
        (f"Cost at {plan['cost']['mfu']:.0%} MFU", _cost_rows(plan["cost"])),
        ("Failures and checkpoints", _failure_rows(plan["failures"])),
    ]


def _cost_rows(cost: dict[str, Any]) -> list[tuple[str, str, str]]:
    peak = human_flops(cost["peak_flops_per_gpu"]).replace("FLOP", "FLOP/s")
    return [
        ("GPUs", f"{cost['world_size']:,} x {cost['gpu']}", f"peak {peak} dense BF16 each"),
        ("MFU", f"{cost['mfu']:g}", "training.cluster.mfu"),
        ("wall-clock", f"{cost['wall_seconds']:,.0f} s", f"{cost['wall_days']:,.2f} days"),
        ("time per step", f"{cost['step_seconds']:.3f} s", ""),
        ("GPU-hours", f"{cost['gpu_hours']:,.0f}", human_count(cost["gpu_hours"])),
        (
            "energy at TDP",
            f"{cost['energy_mwh']:,.1f} MWh",
            f"{cost['tdp_watts']:g} W per GPU, boards only",
        ),
    ]


def _failure_rows(failures: dict[str, Any]) -> list[tuple[str, str, str]]:
    size = failures["checkpoint_bytes"]
    rows = [
        ("interruptions per GPU-hour", f"{failures['failures_per_gpu_hour']:.3g}", ""),
        (
            "job MTBF",
            f"{failures['job_mtbf_hours']:,.2f} h",
            human_duration(failures["job_mtbf_hours"] * 3600),
        ),
        ("expected interruptions", f"{failures['expected_interruptions']:,.1f}", ""),
        ("restart per interruption", f"{failures['restart_seconds']:,.0f} s", ""),
        (
            "checkpoint size",
            f"{size:,}",
            f"{human_bytes(size)}, {failures['checkpoint_bytes_per_param']} B per parameter",
        ),
        ("checkpoint write", f"{failures['write_seconds']:,.2f} s", "blocks a synchronous save"),
        ("copy to host", f"{failures['host_copy_seconds']:,.2f} s", "blocks an async save"),
    ]
    for mode in ("sync", "async"):
        plan = failures[mode]
        best, ours = plan["optimal"], plan["blueprint"]
        rows += [
            (
                f"{mode}: best interval",
                f"{best['interval_seconds']:,.0f} s",
                f"{best['interval_steps']:,.1f} steps (Daly: {plan['daly_interval_seconds']:,.0f} s)",
            ),
            (
                f"{mode}: lost at best",
                f"{best['lost_fraction']:.3%}",
                f"{best['lost_gpu_hours']:,.0f} GPU-hours",
            ),
            (
                f"{mode}: lost at {ours['interval_steps']:,} steps",
                f"{ours['lost_fraction']:.3%}",
                f"{ours['lost_gpu_hours']:,.0f} GPU-hours",
            ),
        ]
    return rows


def cost_summary(plan: dict[str, Any]) -> str:
    """One line: what the run costs and what failures take from it."""
    cost, failures = plan["cost"], plan["failures"]
    best = failures["async"]["optimal"]
    return (
        f"cost: {cost['gpu_hours']:,.0f} GPU-hours, {cost['wall_days']:,.1f} days on "
        f"{cost['world_size']:,} x {cost['gpu']} at {cost['mfu']:.0%} MFU, "
        f"{cost['energy_mwh']:,.1f} MWh at TDP (GPU boards only); "
        f"{failures['expected_interruptions']:,.1f} interruptions expected, "
        f"{best['lost_fraction']:.2%} of the run lost with async checkpoints every "
        f"{best['interval_steps']:,.0f} steps"
    )


def rich_tables(plan: dict[str, Any]) -> list[Table]:
    tables = []
    for title, rows in plan_tables(plan):
        table = Table(title=title, title_justify="left", show_header=False)
        table.add_column(style="bold")
        table.add_column(justify="right")
        notes = any(row[2] for row in rows)  # no empty column where no row has a note
        if notes:
            table.add_column(style="dim")
        for row in rows:
            table.add_row(*(Text(cell) for cell in row[: 3 if notes else 2]))  # never markup
        tables.append(table)
    return tables


def markdown_report(plan: dict[str, Any], title: str) -> str:
    lines = [f"# {title}", "", cost_summary(plan), ""]
    for section, rows in plan_tables(plan):
        lines += [f"## {section}", "", "| | value | |", "|---|---:|---|"]
        lines += [f"| {a} | {b} | {c} |" for a, b, c in rows]
        lines.append("")
    return "\n".join(lines)


def performance_table(plan: dict[str, Any]) -> list[tuple[str, list[tuple[str, str, str]]]]:
    """The predicted speed and where a step's time goes (none for a plan without one)."""
    perf = plan.get("performance")
    if not perf:
        return []
    step = perf["step_seconds"]
    peak = human_flops(perf["peak_flops_per_gpu"]).replace("FLOP", "FLOP/s")
    rows = [
        ("tokens/s per GPU", f"{perf['tokens_per_s_per_gpu']:,.0f}", f"on {perf['gpu']}"),
        ("step time", f"{step:.3f} s", ""),
        ("MFU", f"{perf['mfu']:.1%}", f"of {peak} dense {perf['peak_format'].upper()}"),
    ]
    for name, value in flatten(perf["breakdown_seconds"]):
        rows.append(
            (name.replace(".", ": ").replace("_", " "), f"{value:.3f} s", f"{value / step:.1%}")
        )
    return [("Predicted speed (docs/performance.md)", rows)]
