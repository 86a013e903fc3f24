"""Human-readable views of a plan: rich tables for the terminal, Markdown for files."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

__all__ = ["flatten", "human_bytes", "human_count", "human_flops", "markdown_report", "rich_tables"]


def _scaled(n: float, units: tuple[tuple[str, float], ...]) -> str:
    for unit, scale in units:
        if abs(n) >= scale:
            return f"{n / scale:.2f}{unit}"
    return f"{n:g}"


def human_count(n: float) -> str:
    """Parameter-style counts: 3.58B, 31.58B (B for billions, as model cards write them)."""
    return _scaled(n, (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)))


def human_flops(n: float) -> str:
    """FLOPs with SI prefixes: 22.28 GFLOP, 5.20e+23 = 520.20 ZFLOP."""
    units = (("Y", 1e24), ("Z", 1e21), ("E", 1e18), ("P", 1e15), ("T", 1e12), ("G", 1e9))
    return _scaled(n, tuple((f" {u}FLOP", s) for u, s in units)) if n else "0"


def human_bytes(n: float) -> str:
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def flatten(data: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """Leaf values of nested dicts as (dotted.key, value)."""
    for key, value in data.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, dict):
            yield from flatten(value, name)
        else:
            yield name, value


def sections(plan: dict[str, Any]) -> list[tuple[str, list[tuple[str, str, str]]]]:
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
        ("Layout", layout_rows),
        ("Training", training_rows),
    ]


def rich_tables(plan: dict[str, Any]) -> list[Any]:
    from rich.table import Table

    tables = []
    for title, rows in sections(plan):
        table = Table(title=title, title_justify="left", show_header=False)
        table.add_column(style="bold")
        table.add_column(justify="right")
        table.add_column(style="dim")
        for row in rows:
            table.add_row(*row)
        tables.append(table)
    return tables


def markdown_report(plan: dict[str, Any], title: str) -> str:
    lines = [f"# {title}", ""]
    for section, rows in sections(plan):
        lines += [f"## {section}", "", "| | value | |", "|---|---:|---|"]
        lines += [f"| {a} | {b} | {c} |" for a, b, c in rows]
        lines.append("")
    return "\n".join(lines)
