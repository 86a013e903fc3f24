"""The layout search's answer as text: a table of the fastest layouts (``factory plan
--search``) and a JSON-ready list of them."""

from __future__ import annotations

from typing import Any

from rich.table import Table
from rich.text import Text

from factory.layout_search import SearchResult
from factory.report.units import human_bytes

__all__ = ["search_records", "search_table"]


def _layout(result: SearchResult) -> str:
    p = result.blueprint.parallelism
    vpp = max(1, len(result.blueprint.model.parsed_pattern.segments) // p.pp)
    sp = " sp" if p.sequence_parallel else ""
    return (
        f"tp{p.tp} cp{p.cp} pp{p.pp} vpp{vpp} ep{p.ep} etp{p.expert_tp}{sp} "
        f"mbs{p.micro_batch_size} {p.recompute}"
    )


def search_records(results: list[SearchResult]) -> list[dict[str, Any]]:
    return [
        {
            "layout": _layout(r),
            "overrides": r.overrides,
            "memory_per_rank_bytes": r.memory_bytes,
            "dominant_cost": r.dominant,
            "performance": r.performance.to_dict(),
            "warnings": [
                {"rule": rule, "path": f.path, "message": f.message} for rule, f in r.warnings
            ],
        }
        for r in results
    ]


def search_table(results: list[SearchResult], title: str) -> Table:
    table = Table(title=Text(title), title_justify="left")
    for column, right in (
        ("#", True),
        ("layout", False),
        ("tokens/s/GPU", True),
        ("MFU", True),
        ("memory/rank", True),
        ("dominant cost", False),
    ):
        table.add_column(column, justify="right" if right else "left", overflow="fold")
    for i, r in enumerate(results, 1):
        perf = r.performance
        cells = (
            str(i),
            _layout(r),
            f"{perf.tokens_per_s_per_gpu:,.0f}",
            f"{perf.mfu:.1%}",
            human_bytes(r.memory_bytes),
            r.dominant,
        )
        table.add_row(*(Text(cell) for cell in cells))
    return table
