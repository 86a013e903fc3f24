"""Human-readable views of a plan: rich tables for the terminal, Markdown for files."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

__all__ = ["flatten", "human_bytes", "human_count", "markdown_report", "rich_tables"]


def human_count(n: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{unit}"
    return f"{n:g}"


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


def _sections(plan: dict[str, Any]) -> list[tuple[str, list[tuple[str, str, str]]]]:
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
        (key, f"{value:,.0f}" if isinstance(value, float) else f"{value:,}", human_count(value))
        for key, value in flatten(flops)
        if isinstance(value, (int, float)) and key != "seq_len"
    ]
    flop_rows.insert(0, ("seq_len", str(flops["seq_len"]), ""))
    memory_rows = [
        (key, f"{value:,}", human_bytes(value))
        for key, value in flatten(plan["memory_per_rank_bytes"])
        if isinstance(value, (int, float))
        and not isinstance(value, bool)
        and not key.endswith(
            (
                "microbatches",
                "rank",
                "params_on_rank.dense",
                "params_on_rank.replicated",
                "params_on_rank.expert",
            )
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
            human_count(training["total_flops"]),
        ),
    ]
    return [
        ("Parameters", param_rows),
        ("Training FLOPs per token (fwd+bwd)", flop_rows),
        ("Memory per rank (peak rank)", memory_rows),
        ("Layout", layout_rows),
        ("Training", training_rows),
    ]


def rich_tables(plan: dict[str, Any]) -> list[Any]:
    from rich.table import Table

    tables = []
    for title, rows in _sections(plan):
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
    for section, rows in _sections(plan):
        lines += [f"## {section}", "", "| | value | |", "|---|---:|---|"]
        lines += [f"| {a} | {b} | {c} |" for a, b, c in rows]
        lines.append("")
    return "\n".join(lines)
